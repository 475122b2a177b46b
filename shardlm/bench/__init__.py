"""Benchmarks: speed, memory and communication measured side by side (`make bench`)."""
