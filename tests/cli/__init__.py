"""Tests of the `bargein` command."""
