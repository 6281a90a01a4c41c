"""Tests of bargein.kernels."""
