"""Benchmarks, censuses and the GPU check: what measures the project, as opposed to tools/, what a user runs.
Each bench_*.py runs by its path (python benchmarks/bench_training.py --help); docs/benchmarks.md has their numbers."""
