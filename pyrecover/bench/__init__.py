"""Benchmarks: one module per benchmark, on shared timing and reporting helpers."""
