"""Benchmarks and GPU checks, run from the repository root as `python -m bench.<name>` (see bench/README.md)."""
