"""`lattice-pool ps`: the running pool's models and their memory, asked over
its control socket with a `status` op (so every figure is measured now)."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import msgspec

from ipc.events import PREFIX
from ipc.worker_events import event_body, parse_event
from supervisor.status import Status, StatusRow, read_status

COLUMNS = ("NAME", "ADAPTER", "FORMAT", "STATE", "MEMORY", "PID", "UPTIME", "REQUESTS")
# status_fields may wait 2 s for each worker's stats reply, in parallel.
TIMEOUT = 15.0


class NoPool(Exception):
    """The pool cannot be asked; the message says why, for a person."""


def query_status(path: Path, timeout: float = TIMEOUT) -> Status:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except FileNotFoundError:
            raise NoPool(f"no lattice-pool is running (no control socket at {path})") from None
        except ConnectionRefusedError:
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                raise NoPool(f"{path} is not a socket") from None
            raise NoPool(f"no lattice-pool is running ({path} was left by a pool that has ended)") from None
        except PermissionError:
            raise NoPool(f"cannot connect to {path}: permission denied (a pool of another user?)") from None
        except OSError as exc:
            raise NoPool(f"cannot connect to {path}: {exc.strerror or exc}") from None
        sock.sendall(b'{"op":"status"}\n')
        sock.shutdown(socket.SHUT_WR)
        return _read_status(sock, path)
    except socket.timeout:
        raise NoPool(f"the pool at {path} did not answer within {timeout:g}s") from None
    finally:
        sock.close()


def _read_status(sock: socket.socket, path: Path) -> Status:
    buf = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            raise NoPool(f"the pool at {path} closed the connection without a status reply")
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if not line.startswith(PREFIX):
                continue
            event = parse_event(line)
            if event.get("ev") == "status":
                return read_status(event_body(line))
            if event.get("ev") == "error":
                raise NoPool(f"the pool refused the status op: {event.get('msg')}")


def human_bytes(n: int) -> str:
    """Decimal units, as `ollama ps` and macOS's Activity Monitor count them."""
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000:
            break
        value /= 1000
    else:
        unit = "TB"
    if unit == "B":
        return f"{n} B"
    return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"


def human_duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _adapter(lora: str | None) -> str:
    if not lora:
        return "-"
    home = str(Path.home())
    return "~" + lora[len(home) :] if lora.startswith(home + "/") else lora


def _requests(row: StatusRow) -> str:
    waiting = [f"{row.in_flight} running"] if row.in_flight else []
    if row.queued:
        waiting.append(f"{row.queued} queued")
    return f"{row.served}" + (f" ({', '.join(waiting)})" if waiting else "")


def cells(row: StatusRow) -> tuple[str, ...]:
    running = row.pid is not None
    return (
        row.model,
        _adapter(row.lora),
        row.format or "-",
        row.state,
        human_bytes(row.rss_bytes) if running else "-",
        str(row.pid) if running else "-",
        human_duration(row.uptime_s) if running else "-",
        _requests(row),
    )


def rank_cells(row: StatusRow) -> list[tuple[str, ...]]:
    """One line under a model split over processes for each of its ranks:
    where it runs, its memory and pid."""
    return [
        (f"  rank {r.rank} {r.host}", "", "", "", human_bytes(r.rss_bytes), str(r.pid) if r.pid is not None else "-", "", "")
        for r in (row.ranks if row.pid is not None and row.ranks else ())
    ]


def table(status: Status) -> str:
    rows = [COLUMNS] + [line for r in sorted(status.models, key=lambda r: (r.model, r.lora or "")) for line in (cells(r), *rank_cells(r))]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "".join("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n" for r in rows)


def as_json(status: Status) -> str:
    return json.dumps(msgspec.to_builtins(status), indent=2) + "\n"
