"""GPU-machine checks and benchmarks (run through the device tool, not in CI)."""
