"""Benchmarks: scripts that print ratios; results are kept in docs/."""
