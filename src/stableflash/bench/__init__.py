"""Benchmarks behind `stableflash bench` (GPU)."""
