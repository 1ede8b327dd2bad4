"""Clients of a pool's HTTP surface, polite and hostile."""

from __future__ import annotations

import json
import re
import select
import socket
import time
import urllib.error
import urllib.request

from harness.procs import wait_for


def http_port(pool) -> int:
    found = wait_for(lambda: re.search(rb"http on http://127\.0\.0\.1:(\d+)/v1", pool.stderr), 60, message="the http log line")
    return int(found.group(1))


def with_http(pool):
    """The pool, with `port` and `url` (its /v1 base) read from its log line."""
    pool.port = http_port(pool)
    pool.url = f"http://127.0.0.1:{pool.port}/v1"
    return pool


def split_thinking(text: str) -> tuple[str, str]:
    """A reply that starts inside <think> as (reasoning, answer), the way
    the HTTP surface splits it."""
    if "</think>" not in text:
        return text, ""
    reasoning, answer = text.split("</think>", 1)
    return reasoning, answer.lstrip("\n")


def post(pool, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(pool.url + path, data=body, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# A slow client drips a byte this often; one still open after NEVER
# seconds was never cut off.
DRIP = 0.1
NEVER = 30.0


def _unread(sock: socket.socket) -> bytes:
    """What the peer sent and this side has not read yet, up to its close."""
    out = b""
    while select.select([sock], [], [], 0)[0]:
        try:
            chunk = sock.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    return out


def drip(sock: socket.socket, data: bytes) -> tuple[bytes, float | None]:
    """Sends `data` one byte per DRIP until the peer closes the connection:
    what came back, and the seconds from the first byte to the close (None
    if it never closed)."""
    answer = b""
    start = time.monotonic()
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            # The peer answered and closed while this byte went out: its
            # answer may still wait, unread, in this socket's buffer.
            return answer + _unread(sock), time.monotonic() - start
        readable, _, _ = select.select([sock], [], [], DRIP)
        if readable:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return answer, time.monotonic() - start
            answer += chunk
        if time.monotonic() - start > NEVER:
            break
    return answer, None
