"""Hostile and buggy clients against a real `lattice-pool serve` (fake
workers: the supervisor is what is attacked here): floods into an unread
stdout, idle control and metrics connections, a file-descriptor limit,
and exceptions nobody planned for. Nothing ends or wedges the pool, and
nothing grows without bound."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import resource
import socket
import subprocess
import sys
import threading

import psutil
import pytest

from harness.cli import cli
from harness.fakes import FAKE_ENV, FakeModels
from harness.http import NEVER, drip
from harness.pool import RawPool
from harness.procs import ROOT, child_env, said, wait_for
from supervisor.config import Config, ModelEntry
from supervisor.control import CONTROL_RESERVE
from supervisor.endpoint import dispatch
from supervisor.pool import Pool
from supervisor.terminal import EventSink

# Generous: the bound is what matters, not its size; unbounded, these floods
# grow the supervisor by hundreds of MB.
RSS_BOUND = 64 << 20


@pytest.fixture
def fakes(tmp_path):
    return FakeModels(tmp_path)


def test_a_request_flood_into_an_unread_stdout_is_bounded_and_overloaded(fakes):
    """Requests produce no output while they wait, so the output's
    high-water mark never held this flood back: 200,000 requests were
    queued. Now the queue is bounded, requests beyond it get `overloaded`
    at once, those answers fill the output, and the pool stops reading."""
    fakes.add("a", {"token_interval": 0.01})
    pool = RawPool(fakes.config("heartbeat_interval = 60\nmax_queued = 50\nmax_queued_total = 80"), env=FAKE_ENV)
    total = 200_000
    try:
        pool.read_until(b'"ev":"ready"')
        data = b"".join(b'{"model":"a","id":%d,"prompt":"x","max_tokens":1}\n' % i for i in range(total))
        writer, grown = pool.flood(data)
        assert writer.is_alive(), "the client was never held back"
        assert grown < RSS_BOUND, f"supervisor RSS grew by {grown} bytes"
        pool.finish_flood(writer)
    finally:
        pool.kill()
    ends = [json.loads(line[10:]) for line in pool.out.splitlines() if b'"done":true' in line or b'"ev":"error"' in line]
    assert sorted(e["id"] for e in ends) == list(range(total))  # one terminal line each
    codes = {e.get("code", "done") for e in ends}
    assert codes == {"done", "overloaded"}
    overloaded = next(e for e in ends if e.get("code") == "overloaded")
    assert "max_queued" in overloaded["msg"]


def test_errors_waiting_behind_an_idless_request_are_bounded(fakes, tmp_path):
    """An id-less error must wait for the id-less request running before it
    (a chat_metal client reads terminals in order), so those errors queued
    without bound while it ran. Now at most max_queued_total lines wait, and
    stdin is not read meanwhile."""
    fakes.add("a", {"start_delay": 600})  # the id-less request runs, silently, until unloaded
    sock = tmp_path / "ctl.sock"
    pool = RawPool(fakes.config(f'heartbeat_interval = 60\nmax_queued_total = 100\ncontrol_socket = "{sock}"'), env=FAKE_ENV)
    try:
        pool.read_until(b'"ev":"ready"')
        pool.send({"model": "a", "prompt": "x", "max_tokens": 1})
        writer, grown = pool.flood(b"{}\n" * 1_000_000)
        assert writer.is_alive(), "the client was never held back"
        assert grown < RSS_BOUND, f"supervisor RSS grew by {grown} bytes"
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(sock))
            client.sendall(b'{"op":"unload","model":"a"}\n')  # ends the running request
            pool.finish_flood(writer)
    finally:
        pool.kill()
    # In order: the running request's end, then one error per line.
    done = pool.out.find(b'"done":true,')
    assert 0 <= done < pool.out.find(b'"ev":"error"') and b'"finish_reason":"cancelled"' in pool.out[done : pool.out.find(b"\n", done)]
    assert pool.out.count(b'"ev":"error"') == pool.out.count(b'"code":"bad_request"') == 1_000_000


@pytest.fixture
def ctl(tmp_path):
    return tmp_path / "ctl.sock"


def connect(path) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(30)
    client.connect(str(path))
    return client


def read_all(client: socket.socket) -> bytes:
    """Everything the pool sends until it closes the connection."""
    data = b""
    while chunk := client.recv(65536):
        data += chunk
    return data


def metrics_served(port: int) -> bool:
    """Whether the metrics port serves a whole scrape now (a connection
    refused or cut: not yet)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        try:
            client.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            return b"lattice_supervisor_rss_bytes" in read_all(client)
        except ConnectionError:
            return False


def test_control_clients_are_bounded_and_idle_ones_closed(fakes, spawn_pool, ctl):
    fakes.add("a")
    config = fakes.config(f'control_socket = "{ctl}"\nmax_control_clients = 3\ncontrol_idle_timeout = "1s"', preload=False)
    pool = spawn_pool("--config", config, env=FAKE_ENV)
    said(pool.stderr, b"control socket at", 60)
    idle = [connect(ctl) for _ in range(3 + CONTROL_RESERVE)]  # the last two in the room kept for ps and stop
    for client in idle:  # each is in: it gets answers
        client.sendall(b'{"op":"status"}\n')
        assert b'"ev":"status"' in client.recv(65536)
    with connect(ctl) as extra:
        refused = read_all(extra)
    assert b'"code":"overloaded"' in refused and b"max_control_clients" in refused
    for client in idle:
        assert read_all(client) == b"", "an idle client is closed"
        client.close()
    with connect(ctl) as client:
        client.sendall(b'{"op":"status"}\n')
        assert b'"ev":"status"' in client.recv(65536)
    assert pool.close() == 0


def test_slow_control_and_metrics_clients_are_cut_off_and_ps_still_works(fakes, spawn_pool, ctl):
    """The control socket's and /metrics' time limits were per recv: a
    client sending a byte every few seconds held its connection for ever,
    and clients holding every connection locked out scrapes, `ps` and
    `stop`. Now a request (an op line, a scrape) must arrive whole within
    its request timeout, and two connections beyond max_control_clients
    are kept for one-off commands."""
    fakes.add("a")
    settings = (
        f'control_socket = "{ctl}"\nmax_control_clients = 2\ncontrol_idle_timeout = "5m"\ncontrol_request_timeout = "1s"\n'
        'max_metrics_connections = 2\nmetrics_request_timeout = "1s"'
    )
    pool = spawn_pool("--config", fakes.config(settings, preload=False), "--metrics-port", "0", env=FAKE_ENV)
    found = wait_for(lambda: re.search(rb"metrics on http://127\.0\.0\.1:(\d+)/metrics", pool.stderr), 60, message="the metrics port")
    port = int(found.group(1))
    said(pool.stderr, b"control socket at", 60)
    results: dict[str, tuple[bytes, float | None]] = {}

    def drip_on(name: str, sock: socket.socket, data: bytes) -> None:
        with sock:
            results[name] = drip(sock, data)

    with contextlib.ExitStack() as stack:
        # They take both of max_control_clients' slots; closed whatever fails.
        silent = [stack.enter_context(connect(ctl)) for _ in range(2)]
        for client in silent:
            client.sendall(b'{"op":"status"}\n')
            assert b'"ev":"status"' in client.recv(65536)
        slow = [
            ("control", connect(ctl), b'{"op":"status","pad":"' + b"x" * 1000),
            *((f"metrics {n}", socket.create_connection(("127.0.0.1", port)), b"GET /metrics HTTP/1.1\r\nx-pad: " + b"a" * 1000) for n in range(2)),
        ]
        threads = [threading.Thread(target=drip_on, args=args) for args in slow]
        for thread in threads:
            thread.start()
        try:
            # While the slow ones drip: `ps` comes in through the room kept for it.
            out = cli("ps", "--control-socket", str(ctl))
            assert out.returncode == 0 and b"NAME" in out.stdout, out.stderr
            # A client let into that room that says nothing is closed soon.
            with connect(ctl) as quiet:
                assert read_all(quiet) == b""
        finally:
            for thread in threads:
                thread.join(NEVER + 30)
        for name, (_, closed_after) in results.items():
            assert closed_after is not None and closed_after < 15, f"the slow {name} client was not cut off ({closed_after})"
        assert b"control_request_timeout" in results["control"][0]

        wait_for(lambda: metrics_served(port), 30, interval=0.2, message="a scrape to be served")
        for client in silent:  # quiet, but within control_idle_timeout: still served
            client.sendall(b'{"op":"status"}\n')
            assert b'"ev":"status"' in client.recv(65536)
    assert pool.close() == 0


def test_many_clients_connecting_at_once_are_not_refused_by_the_backlog(fakes, spawn_pool, ctl):
    """With a listen backlog of 16, clients with a connect timeout (a
    non-blocking connect) got EAGAIN when more arrived at once."""
    fakes.add("a")
    pool = spawn_pool("--config", fakes.config(f'control_socket = "{ctl}"', preload=False), env=FAKE_ENV)
    said(pool.stderr, b"control socket at", 60)
    clients = []
    try:
        for _ in range(200):
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            clients.append(client)
            client.setblocking(False)
            client.connect(str(ctl))  # BlockingIOError (EAGAIN) when the backlog is full
    finally:
        for client in clients:
            client.close()
    assert pool.close() == 0


FD_LIMIT = 64


def test_a_worker_start_at_the_file_limit_is_retried_and_recovers(fakes, spawn_pool, ctl):
    """Idle control clients use up the pool's file descriptors (here with
    no bound on them); a worker start then fails with EMFILE. It is retried
    like a crash, and once the clients are gone the model loads and its
    request is answered. The failure used to leave the model `unloaded`
    with its request unanswered forever, and asyncio filled stderr."""
    fakes.add("a")
    config = fakes.config(f'control_socket = "{ctl}"\nmax_control_clients = 1000\ncontrol_idle_timeout = "never"', preload=False)

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    pool = spawn_pool("--config", config, env=FAKE_ENV, preexec_fn=low_limit)
    said(pool.stderr, b"control socket at", 60)
    supervisor = psutil.Process(pool.proc.pid)
    clients = []
    try:
        while (fds := supervisor.num_fds()) < FD_LIMIT:
            clients.append(connect(ctl))
            wait_for(lambda: supervisor.num_fds() > fds, 10, message="the connection to be accepted")
        pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 2})
        restarting = pool.wait_ev("restarting", model="a", timeout=60)
        assert "Too many open files" in restarting["reason"]
    finally:
        for client in clients:
            client.close()
    assert pool.terminal("r1", timeout=60)["gen_tokens"] == 2
    assert not [e for e in pool.events if e["ev"] == "failed"]
    assert pool.close() == 0
    assert len(pool.stderr) < 1 << 20, f"{len(pool.stderr)} bytes of stderr"


def test_metrics_connections_are_bounded(fakes, spawn_pool):
    """prometheus-client's server started a thread per connection, with no
    bound: idle connections piled up threads."""
    fakes.add("a")
    pool = spawn_pool("--config", fakes.config("max_metrics_connections = 2", preload=False), "--metrics-port", "0", env=FAKE_ENV)
    found = wait_for(lambda: re.search(rb"metrics on http://127\.0\.0\.1:(\d+)/metrics", pool.stderr), 60, message="the metrics port")
    port = int(found.group(1))
    supervisor = psutil.Process(pool.proc.pid)
    threads = supervisor.num_threads()
    # asyncio's default executor starts its threads (up to cores + 4) when
    # the pool first hands it work, whenever that is: they are allowed
    # for, and more connections than that are opened.
    executor = min(32, (os.cpu_count() or 1) + 4)
    idle = []
    try:
        for _ in range(30 + executor):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=30))

        def closed_by_the_pool() -> int:
            n = 0
            for client in idle:
                client.setblocking(False)
                try:
                    n += client.recv(1) == b""
                except BlockingIOError:
                    pass
            return n >= len(idle) - 2

        wait_for(closed_by_the_pool, 30, message="connections beyond the bound to be closed")
        # The bound's 2 serving threads: a thread per connection would be
        # 30 more than the executor's.
        assert supervisor.num_threads() <= threads + 2 + executor
    finally:
        for client in idle:
            client.close()

    # Refused (closed at once) until the threads serving the idle ones see them go.
    wait_for(lambda: metrics_served(port), 30, interval=0.2, message="a scrape to be served again")
    assert pool.close() == 0


def test_a_metrics_port_out_of_range_is_a_usage_error():
    out = cli("serve", "--metrics-port", "99999", "--no-control-socket", input=b"")
    assert out.returncode == 2 and b"metrics_port" in out.stderr and b"65535" in out.stderr
    assert b"Traceback" not in out.stderr


def test_an_unexpected_exception_on_a_line_is_answered_internal(tmp_path, caplog):
    """Whatever a line meets that nobody planned for is answered with the
    error code `internal` and its id, logged with its traceback, and the
    next line is served."""
    lines: list[dict] = []

    def broken(*args, **kwargs):
        raise ZeroDivisionError("planted")

    async def main() -> None:
        pool = Pool(Config(models=[ModelEntry(name="a", path=str(tmp_path))]), EventSink(lambda event, line: lines.append(event)))
        real = pool.resolver.resolve
        pool.resolver.resolve = broken
        dispatch(pool, b'{"id":"r1","prompt":"hi"}')
        dispatch(pool, b'{"op":"unload","model":"a","id":"op1"}')
        pool.resolver.resolve = real
        dispatch(pool, b'{"op":"unload","model":"a","id":"op2"}')

    with caplog.at_level(logging.ERROR, logger="lattice"):
        asyncio.run(main())
    assert [(e["ev"], e.get("code"), e.get("id")) for e in lines] == [("error", "internal", "r1"), ("error", "internal", "op1"), ("unloaded", None, None)]
    assert "ZeroDivisionError: planted" in lines[0]["msg"]
    assert sum(1 for r in caplog.records if r.exc_info and "planted" in str(r.exc_info[1])) == 2


def test_a_pool_whose_endpoint_dies_exits_non_zero(fakes):
    """Every line is its own boundary, so this takes a planted bug: a pool
    that stops reading stdin must not exit 0 as if stdin had closed."""
    fakes.add("a")
    code = (
        "import sys, supervisor.lifecycle\n"
        "async def broken(pool):\n    raise ZeroDivisionError('planted')\n"
        "supervisor.lifecycle.serve_stdin = broken\n"
        "from supervisor.cli import main\n"
        f"sys.exit(main(['serve', '--config', {fakes.config(preload=False)!r}, '--no-control-socket']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=b"", capture_output=True, env=child_env(**FAKE_ENV), cwd=ROOT, timeout=120)
    assert out.returncode == 70, out.stderr
    assert b"the stdin endpoint failed" in out.stderr and b"ZeroDivisionError: planted" in out.stderr
