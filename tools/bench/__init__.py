"""Benchmarks, one folder per technique; shared helpers in tools/bench/common.py. See tools/README.md."""
