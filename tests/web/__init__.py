"""Tests of the web chat (bargein/server/static) in a real browser."""
