"""Benchmarks behind `retouch bench`: each compares configurations side by side in one run."""
