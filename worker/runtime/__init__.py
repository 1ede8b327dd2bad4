"""What every part of the worker stands on: loading a model directory, measured memory, tunable defaults, and the backend set-up (CPU BLAS, CUDA kernel cache)."""
