"""The OpenAI-compatible HTTP surface (docs/http.md).

shapes.py turns OpenAI request bodies into the pool's ClientLine and the
pool's answers into OpenAI's JSON; reasoning.py splits thinking text from
the answer; exchange.py is one request's sink, with its bounded stream
buffer; server.py runs uvicorn on the pool's event loop. Only server.py
imports uvicorn, and only `http` in the config imports server.py.
"""
