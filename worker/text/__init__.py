"""Tokens in and out: the tokenizer and chat template, prompts, and per-row streaming of event lines."""
