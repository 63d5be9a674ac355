"""Benchmarks: side-by-side measurements of the app against plain PyTorch loops (see bench/README.md)."""
