"""Tests of bargein.server."""
