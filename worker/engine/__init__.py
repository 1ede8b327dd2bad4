"""The batched engine: the decode step, its caches, sampling, structured output and speculation."""
