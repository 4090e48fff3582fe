"""Benchmarks for otfload: synthetic checkpoints, baseline loaders and the load benchmark."""
