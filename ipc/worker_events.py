"""Worker -> supervisor: the lines a worker writes, read back once, typed.

A worker writes `@@lattice` lines only (ipc.events encodes them) and ends
with an exit status. The supervisor reads every line through `read_line`,
once: a non-final token line stays bytes (it is relayed as the worker wrote
it, and only the id at its tail matters); every other line becomes one of
the Structs below, tagged by its "ev" (a msgspec tagged union, so one
decoder reads them all), an `Other` event of a kind the supervisor does not
interpret (relayed as is), or `Malformed`.

Every line of a request that carries an id ends with `,"id":<id>}`; inside
a JSON string a quote is always escaped, so the last `,"id":` of a line is
that field (`line_id`).
"""

from __future__ import annotations

import re

import msgspec
import psutil

from ipc.events import FINAL, ID_TAIL, LINE_END, NOT_FINAL, PREFIX, TOKEN_HEAD

# The worker's exit status when restarting cannot help: a bad model dir, a
# resource limit (sysexits.h's EX_CONFIG).
# Its one-line cause is the last line it wrote on stderr.
EX_CONFIG = 78

# A worker's stderr: its log records start with logging's asctime; its
# fatal message, the one-line cause it writes last before it exits, with
# FATAL_PREFIX.
FATAL_PREFIX = "lattice-pool worker: "
LOG_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")

# Events a worker writes for the supervisor alone; never relayed to clients.
HEARTBEAT = "heartbeat"
WORKER_STATS = "worker_stats"
# Events the pool writes (or relays) about a model's life, as opposed to a
# request's lines: the control socket copies these to its clients.
LIFECYCLE = frozenset({"loading", "ready", "unloaded", "restarting", "failed", "adapter_loaded", "adapter_error", "stats"})


class Done(msgspec.Struct, tag_field="ev", tag="gen_token"):
    """The final line of a request (`"done":true`)."""

    prompt_tokens: int = 0
    gen_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float = 0.0
    tok_s: float = 0.0
    total_ms: float = 0.0
    finish_reason: str | None = None
    # Present when the request ran with a drafter (speculative decoding).
    drafted_tokens: int = 0
    accepted_tokens: int = 0


class Error(msgspec.Struct, tag_field="ev", tag="error"):
    msg: str = ""
    code: str | None = None


class Ready(msgspec.Struct, tag_field="ev", tag="ready"):
    model: str | None = None
    format: str | None = None
    load_ms: int = 0
    # The chat template's generation prompt opens a <think> block.
    opens_think: bool = False


class Loading(msgspec.Struct, tag_field="ev", tag="loading"):
    model: str | None = None
    bytes_loaded: int = 0
    bytes_total: int = 0


class Heartbeat(msgspec.Struct, tag_field="ev", tag=HEARTBEAT):
    busy: bool = False


class AdapterFigures(msgspec.Struct):
    """One resident adapter of a worker, as its worker_stats lists it."""

    lora: str
    sha256: str | None = None
    config_sha256: str | None = None
    bytes: int = 0  # its own factors, in the model's dtype (no padding)
    rows: int = 0  # batch rows running with it


class MemoryFigures(msgspec.Struct, kw_only=True):
    """A worker process's measured memory (docs/monitoring.md), declared
    once for a rank, a worker and a status row."""

    rss_bytes: int = 0
    uss_bytes: int = 0
    mlx_active_bytes: int = 0
    mlx_peak_bytes: int = 0
    mlx_cache_bytes: int = 0
    weights_bytes: int = 0


class RankFigures(MemoryFigures):
    """One process of a model split over several (docs/scaling.md): where it
    runs and its own measured memory."""

    rank: int
    host: str
    pid: int | None = None


class WorkerStats(MemoryFigures, tag_field="ev", tag=WORKER_STATS):
    """The worker's measured memory and batch figures (docs/monitoring.md).
    A model split over several processes reports each one in `ranks`, and
    the sums of their figures in its memory fields."""

    format: str | None = None
    processor: str | None = None  # cpu, metal or cuda
    adapter_bytes: int = 0
    active_rows: int = 0
    waiting_rows: int = 0
    rows_cache_bytes: int = 0
    max_batch: int = 0
    # Every adapter array held (padding, superseded versions still in use):
    # adapter_bytes; each resident adapter on its own: adapters.
    adapters: list[AdapterFigures] = []
    max_adapters: int = 0
    ranks: list[RankFigures] | None = None
    # The memory of the device it computes on: the GPU's on CUDA, the
    # machine's on a CPU or Apple silicon (0: not known yet).
    device_memory_bytes: int = 0
    seq: int = 0  # the Stats message it answers (ipc.messages.Stats)


# The adapter events name the adapter by its path, as the pool sent it.


class AdapterLoaded(msgspec.Struct, tag_field="ev", tag="adapter_loaded"):
    lora: str | None = None
    sha256: str | None = None


class AdapterError(msgspec.Struct, tag_field="ev", tag="adapter_error"):
    lora: str | None = None
    msg: str = ""


class AdapterUnloaded(msgspec.Struct, tag_field="ev", tag="adapter_unloaded"):
    """The answer to UnloadAdapter; `resident`: it was in memory."""

    lora: str | None = None
    resident: bool = False


class Other(msgspec.Struct):
    """A well-formed event of a kind the supervisor passes on untouched."""

    ev: str


class Malformed(msgspec.Struct):
    """A line that is no event we can read. `terminal`: it claimed to end a
    request (a done or error line), so that request cannot end through it."""

    why: str
    terminal: bool = False


class _Token:
    __slots__ = ()

    def __repr__(self) -> str:
        return "TOKEN"


TOKEN = _Token()  # a non-final token line: relay its bytes

WorkerEvent = Done | Error | Ready | Loading | Heartbeat | WorkerStats | AdapterLoaded | AdapterError | AdapterUnloaded
_decoder = msgspec.json.Decoder(WorkerEvent)
_KNOWN = frozenset(t.__struct_config__.tag for t in WorkerEvent.__args__)
_TERMINAL = frozenset({"gen_token", "error"})
_object = msgspec.json.Decoder(dict)
_string = msgspec.json.Decoder(str)
_EVENT_HEAD = PREFIX + b'{"ev":"'
_TOKEN_LINE_START = b"\n" + TOKEN_HEAD


def event_name(line: bytes) -> str:
    """The `ev` of a line whose JSON starts with it (every encoder in
    ipc.events writes it first), without decoding JSON; "" for others."""
    if not line.startswith(_EVENT_HEAD):
        return ""
    end = line.find(b'"', len(_EVENT_HEAD))
    return line[len(_EVENT_HEAD) : end].decode("utf-8", "replace") if end > 0 else ""


def is_token(line: bytes) -> bool:
    """A non-final gen_token line. Inside the escaped token text every quote
    is written as \\", so the bytes `"done":true` can only be the field."""
    return line.startswith(TOKEN_HEAD) and FINAL not in line


def token_block(block: bytes) -> int:
    """The number of lines of a block of whole lines when every one of them
    is a non-final token line, else 0; found by searches that run in C, so
    a flood costs no Python per line."""
    lines = block.count(b"\n")
    if is_token(block) and block.count(_TOKEN_LINE_START) == lines - 1:
        return lines
    return 0


def holds(block: bytes, key: bytes | None, lines: int) -> bool:
    """Whether a block of `lines` token lines holds a line of the request
    whose id is `key` (its id tail ends a line), or for key None, of the
    request without an id (a line has no id)."""
    if key is None:
        return block.count(ID_TAIL) < lines
    return ID_TAIL + key + LINE_END in block


def read_line(line: bytes) -> _Token | WorkerEvent | Other | Malformed:
    """The one reading of a worker line (with its newline)."""
    name = event_name(line)
    if not name or not line.endswith(b"}\n"):
        return Malformed("not an event line")
    if name == "gen_token" and FINAL not in line:
        return TOKEN
    body = line[len(PREFIX) :]
    if name in _KNOWN:
        try:
            return _decoder.decode(body)
        except msgspec.DecodeError as exc:
            return Malformed(f"a malformed {'final' if name == 'gen_token' else name} line ({exc})", name in _TERMINAL)
    try:
        _object.decode(body)
    except msgspec.DecodeError as exc:
        return Malformed(f"not a JSON object ({exc})")
    return Other(name)


def line_id(line: bytes) -> bytes | None:
    """The id of a request's line as the JSON text it carries, or None for a
    line without one."""
    at = line.rfind(ID_TAIL)
    return None if at < 0 else line[at + len(ID_TAIL) : -len(LINE_END)]


def token_json(line: bytes) -> bytes | None:
    """The token of a non-final token line (read_line: TOKEN) as the JSON
    string the worker wrote, undecoded; None for a line not laid out as
    ipc.events writes them."""
    end = line.rfind(NOT_FINAL)
    return line[len(TOKEN_HEAD) : end] if end > 0 and line.startswith(TOKEN_HEAD) else None


def token_text(token: bytes) -> str:
    """token_json's JSON string decoded. Raises msgspec.DecodeError when it
    is none."""
    return _string.decode(token)


def event_body(line: bytes) -> bytes:
    """The JSON object of an event line."""
    return line[len(PREFIX) :] if line.startswith(PREFIX) else line


def parse_event(line: bytes) -> dict:
    """Any event line as a dict, for clients that show events (not the relay)."""
    return _object.decode(event_body(line))


def rss_uss(pid: int | None = None) -> dict[str, int]:
    """`rss_bytes` and `uss_bytes` of process `pid` (default: this one) as
    worker_stats reports them: USS where the OS has it, else RSS; 0 when the
    process cannot be read."""
    try:
        info = psutil.Process(pid).memory_full_info()
    except psutil.Error:
        return {"rss_bytes": 0, "uss_bytes": 0}
    return {"rss_bytes": int(info.rss), "uss_bytes": int(getattr(info, "uss", info.rss))}
