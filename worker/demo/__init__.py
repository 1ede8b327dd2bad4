"""Demo models built locally: the tiny test model and the benchmark-sized shapes."""
