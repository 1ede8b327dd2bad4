"""`lattice-pool ps`: the running pool's models and their memory, asked over
its control socket with a `status` op (so every figure is measured now)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from supervisor.control_client import ControlConnection, NoPool
from supervisor.local_models import short_path
from supervisor.policy import footprint_of
from supervisor.status import Status, StatusRow, read_status

COLUMNS = ("NAME", "ADAPTER", "FORMAT", "STATE", "MEMORY", "PROCESSOR", "CONTEXT", "PID", "UPTIME", "UNTIL", "REQUESTS")
# status_fields may wait 2 s for each worker's stats reply, in parallel.
TIMEOUT = 15.0
# The worker's `processor` as `ollama ps` names it.
PROCESSORS = {"cpu": "CPU", "metal": "Metal", "cuda": "GPU"}

__all__ = ["NoPool", "query_status", "table", "as_json"]


def query_status(path: Path, timeout: float = TIMEOUT) -> Status:
    with ControlConnection(path, timeout) as conn:
        conn.send({"op": "status"}, last=True)
        for event, body in conn.events():
            if event.get("ev") == "status":
                return read_status(body)
            if event.get("ev") == "error":
                raise NoPool(f"the pool refused the status op: {event.get('msg')}")
    raise NoPool(f"the pool at {path} closed the connection without a status reply")


def human_bytes(n: int) -> str:
    """Decimal units, as `ollama ps` and macOS's Activity Monitor count them."""
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):  # noqa: B007 (the unit the break stops at)
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


def until(row: StatusRow) -> str:
    """When keep_alive unloads it, as `ollama ps` says it."""
    if row.state == "stopping":
        return "Stopping..."
    if row.expires_in_s is None:
        return "Forever"
    s = int(row.expires_in_s)
    for size, unit in ((86400, "day"), (3600, "hour"), (60, "minute")):  # noqa: B007 (the unit the break stops at)
        if s >= size:
            break
    else:
        size, unit = 1, "second"
    n = s // size
    return f"{n} {unit}{'' if n == 1 else 's'} from now"


def _adapter(lora: str | None) -> str:
    return short_path(Path(lora)) if lora else "-"


def _requests(row: StatusRow) -> str:
    waiting = [f"{row.in_flight} running"] if row.in_flight else []
    if row.queued:
        waiting.append(f"{row.queued} queued")
    return f"{row.served}" + (f" ({', '.join(waiting)})" if waiting else "")


def cells(row: StatusRow, under: bool = False) -> tuple[str, ...]:
    """A name's cells; `under` another name of its worker, indented, with
    the bytes its adapter adds to the worker as its MEMORY. MEMORY is what
    eviction counts (supervisor.policy.footprint), so that a GPU's weights
    and caches show, which its RSS does not."""
    running = row.pid is not None
    if not running or row.error is not None:
        memory = "-"
    elif under:
        memory = "+" + human_bytes(row.adapter_bytes)
    else:
        memory = human_bytes(footprint_of(row))
    return (
        "  " + row.model if under else row.model,
        _adapter(row.lora),
        row.format or "-",
        row.state,
        memory,
        PROCESSORS.get(row.processor or "", row.processor or "-") if running else "-",
        str(row.max_context) if row.max_context else "-",
        str(row.pid) if running else "-",
        human_duration(row.uptime_s) if running else "-",
        until(row),
        _requests(row),
    )


def rank_cells(row: StatusRow) -> list[tuple[str, ...]]:
    """One line under a model split over processes for each of its ranks:
    where it runs, its memory and pid."""
    return [
        (f"  rank {r.rank} {r.host}", "", "", "", human_bytes(footprint_of(r)), "", "", str(r.pid) if r.pid is not None else "-", "", "", "")
        for r in (row.ranks if row.pid is not None and row.ranks else ())
    ]


def by_worker(models: list[StatusRow]) -> list[list[StatusRow]]:
    """The rows of each worker, its names without adapter first."""
    groups: dict[int, list[StatusRow]] = {}
    for row in sorted(models, key=lambda r: (r.lora is not None, r.model, r.lora or "")):
        groups.setdefault(row.worker, []).append(row)
    return sorted(groups.values(), key=lambda g: (g[0].model, g[0].lora or ""))


def columns(rows: list[tuple[str, ...]]) -> str:
    """Rows (a header first) as aligned columns, as `ollama ps` prints them."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "".join("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n" for r in rows)


def table(status: Status) -> str:
    lines = [COLUMNS]
    errors = []
    for group in by_worker(status.models):
        for i, row in enumerate(group):
            lines += [cells(row, under=i > 0), *rank_cells(row)]
            if row.error is not None:
                errors.append(f"{row.model} ({_adapter(row.lora)}): {row.error}\n")
    # Below the table: a reason would stretch its columns.
    return columns(lines) + "".join(errors)


def as_json(status: Status) -> str:
    return json.dumps(msgspec.to_builtins(status), indent=2) + "\n"
