"""Tests of the benchmarks' own logic (bench/): pure functions, no model, no server."""
