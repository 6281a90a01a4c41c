"""Tests of bargein.engine."""
