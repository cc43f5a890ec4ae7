"""Benchmarks: `slipstream bench` (bench/), engine, kernel, accuracy, start-up and soak tools."""
