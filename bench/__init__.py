"""Serving and micro benchmarks, their result files and plots."""
