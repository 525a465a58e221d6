"""kai_fractions performance harness: `python -m benchmarks.run` (see benchmarks/README.md)."""
