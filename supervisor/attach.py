"""How `chat` and `run` reach a pool: their own (PoolLink over a
RunningPool), or one already running, over its control socket (RemoteLink).

A running pool is reached through its control socket rather than its HTTP
surface: every pool has the socket unless told otherwise (`serve`, `chat`,
`run --json --serve`), found by the rules `ps` uses, private to the user
(mode 0600, no API key to pass around), and it carries the pool's own
`@@lattice` lines, so the front ends read the same events either way. The
HTTP surface is off unless asked for and speaks OpenAI's shapes instead.
A request goes as a `generate` op, whose lines come back on the same
connection; the pool cancels it if the connection closes first.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import msgspec

from ipc.events import PREFIX
from supervisor.lifecycle import RunningPool
from supervisor.requests import ClientLine
from supervisor.resolve import UnknownModel
from supervisor.stdout import Tapped

log = logging.getLogger("lattice.attach")

# A pool answers `status` within a few seconds (status_fields waits 2 s per
# worker, in parallel); connecting is local.
CONNECT_TIMEOUT = 5.0
STATUS_TIMEOUT = 15.0
# The longest line read from the pool: a status event of many models.
MAX_LINE = 16 * 1024 * 1024


class PoolLink:
    """The front end's own pool, started in this process."""

    remote = False

    def __init__(self, running: RunningPool):
        self.running = running
        self.pool = running.pool
        self.stopped = running.pool.shutdown_requested

    def name_of(self, ref: str | None) -> str:
        """The name the pool's events give the model `ref`; UnknownModel if none."""
        spec = self.pool.resolve(ref)
        return self.pool.model_state(spec).worker or spec.name

    def load(self, ref: str | None) -> None:
        self.pool.ops.load(self.pool.resolve(ref))

    def unload(self, ref: str | None, reason: str) -> bool:
        """False when the model is not loaded."""
        spec = self.pool.resolve(ref)
        if self.pool.model_state(spec).worker is None:
            return False
        self.pool.unload(spec, reason)
        return True

    def submit(self, request: ClientLine, sink) -> None:
        self.pool.submit(request, sink)

    def cancel(self, id_json: str) -> None:
        self.pool.cancel(id_json)

    async def close(self) -> None:
        await self.running.stop(0)


class RemoteLink:
    """A pool already running, over its control socket."""

    remote = True

    def __init__(self, path: Path, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sink: Tapped, default: str | None):
        self.path = path
        self._reader = reader
        self._writer = writer
        self._sink = sink
        self.default = default
        self.lora: str | None = None  # the adapter of the default model's requests (--lora)
        self.stopped = asyncio.Event()  # the pool closed the connection (it stopped)
        self._reading = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, path: Path | None, sink: Tapped, ref: str | None) -> RemoteLink | None:
        """The pool at `path`, or None when none answers there. `ref` (the
        model asked for) None: the pool's one model, else UnknownModel."""
        if path is None:
            return None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path), limit=MAX_LINE), CONNECT_TIMEOUT)
        except (TimeoutError, OSError):
            return None
        try:
            default = ref if ref is not None else await _only_model(reader, writer, path)
        except BaseException:
            writer.close()
            raise
        return cls(path, reader, writer, sink, default)

    async def _read(self) -> None:
        try:
            while True:
                line = await self._reader.readline()
                if not line:
                    break
                if line.startswith(PREFIX):
                    self._sink.write(line)
        except (OSError, ValueError, asyncio.LimitOverrunError) as exc:
            log.warning("the pool at %s: connection lost (%s)", self.path, exc)
        finally:
            self.stopped.set()

    def send(self, op: dict) -> None:
        if not self._writer.is_closing():
            self._writer.write(msgspec.json.encode({k: v for k, v in op.items() if v is not None}) + b"\n")

    def name_of(self, ref: str | None) -> str:
        return ref if ref is not None else self.default

    def _lora(self, ref: str | None) -> str | None:
        return self.lora if ref is None or ref == self.default else None

    def load(self, ref: str | None) -> None:
        self.send({"op": "load", "model": self.name_of(ref), "lora": self._lora(ref)})

    def unload(self, ref: str | None, reason: str) -> bool:
        # The pool answers `unloaded` (reason "not loaded" when it was not).
        self.send({"op": "unload", "model": self.name_of(ref), "lora": self._lora(ref)})
        return True

    def submit(self, request: ClientLine, sink) -> None:
        """Its lines reach `sink` as the pool writes them (sink is this
        link's own: every line from the pool goes there)."""
        fields = {f: getattr(request, f) for f in request.__struct_fields__}
        fields = {k: v for k, v in fields.items() if v is not None and not (isinstance(v, msgspec.Raw) and not bytes(v))}
        fields["op"] = "generate"
        fields["model"] = self.name_of(request.model)
        if "lora" not in fields and self._lora(request.model):
            fields["lora"] = self._lora(request.model)
        self.send(fields)

    def cancel(self, id_json: str) -> None:
        self.send({"op": "cancel", "id": msgspec.json.decode(id_json)})

    async def close(self) -> None:
        # The pool cancels what this connection still has running.
        self._writer.close()
        self._reading.cancel()
        await asyncio.gather(self._reading, return_exceptions=True)


async def _only_model(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: Path) -> str:
    """The model a front end gets from a running pool when it names none:
    the one model (without adapter) the pool has."""
    writer.write(b'{"op":"status"}\n')
    while True:
        line = await asyncio.wait_for(reader.readline(), STATUS_TIMEOUT)
        if not line:
            raise UnknownModel(f"the pool at {path} closed the connection")
        if line.startswith(PREFIX + b'{"ev":"status"'):
            rows = msgspec.json.decode(line[len(PREFIX) :])["models"]
            break
    names = sorted({row["model"] for row in rows if row.get("lora") is None})
    if len(names) == 1:
        return names[0]
    which = f"it serves {', '.join(names)}" if names else "it has no model loaded"
    raise UnknownModel(f"a pool is running at {path} and {which}: give --model NAME (or --own-pool for a pool of this command's own)")
