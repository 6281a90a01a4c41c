"""Tests of bargein.distributed."""
