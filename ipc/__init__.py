"""The only package both the supervisor and the worker import: the wire formats."""
