"""Shared pieces of the benchmark scripts (not benchmarks themselves)."""
