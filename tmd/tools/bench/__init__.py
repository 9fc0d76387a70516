"""Benchmarks: `tmd bench NAME` commands that print one JSON object."""
