"""The prefix cache and its disk tier."""
