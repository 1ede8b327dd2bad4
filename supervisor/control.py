"""The control socket: the stdin ops, minus generation, for a second client.

Studio owns stdin and stdout; `lattice-pool ps`, scripts and a second app
reach the running pool through a unix socket instead. Protocol (see
docs/monitoring.md): NDJSON op lines in, `@@lattice` lines back on the same
connection — the op's own reply (a `status` event, an `error`, ...) and,
while the connection stays open, a copy of every lifecycle event the pool
writes to stdout, so a client that sent `load` can wait for `ready`.
A `generate` op is a generation request whose lines (tokens included) go
back to the connection that sent it, and only there; `chat` and `run` use
it to share a running pool. Other token streams never go to the socket.

Bounds (docs/monitoring.md): `max_control_clients` connections, and
CONTROL_RESERVE more kept for one-off commands such as `ps` and `stop`
(those must send their op within `control_request_timeout` and are closed
once quiet that long); an op line must arrive whole within
`control_request_timeout` of its first byte, however it trickles; a
connection quiet both ways for `control_idle_timeout` is closed.

The socket is created mode 0600 inside a private directory and only then
linked to its public name, so it is never reachable by others, not even
for an instant; a stale socket left by a killed pool is replaced, a live
one is never taken over.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

from ipc.events import BAD_REQUEST, INTERNAL, OVERLOADED, encode_error
from ipc.worker_events import LIFECYCLE, event_name
from supervisor.child import RESOURCE_ERRNOS
from supervisor.config import Config, ConfigError, parse_duration
from supervisor.endpoint import LineSplitter, internal_error, read_line
from supervisor.pool import Pool
from supervisor.requests import REQUEST_OPS, BadRequest

log = logging.getLogger("lattice.control")

SOCKET_ENV = "LATTICE_CONTROL_SOCKET"
MAX_LINE = 1024 * 1024
# A client that stops reading is dropped once this much waits for it, so it
# can never grow the supervisor's memory.
MAX_BACKLOG = 1024 * 1024
ACCEPT_RETRY_DELAY = 1.0
# Connections let in beyond max_control_clients, each for a short while, so
# that clients holding every slot cannot lock `ps` and `stop` out.
CONTROL_RESERVE = 2


def default_socket_path() -> Path:
    """$LATTICE_CONTROL_SOCKET, else $XDG_RUNTIME_DIR/lattice-pool.sock (a
    per-user 0700 directory), else ~/.lattice/pool.sock."""
    if os.environ.get(SOCKET_ENV):
        return Path(os.environ[SOCKET_ENV]).expanduser()
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "lattice-pool.sock"
    return Path.home() / ".lattice" / "pool.sock"


def socket_path(config: Config) -> Path | None:
    if config.control_socket is False:
        return None
    if config.control_socket is True:
        return default_socket_path()
    return Path(config.control_socket).expanduser()


def _probe(path: Path) -> bool:
    """True when a process accepts connections on the socket at `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        # No permission, or a listener too busy to accept: someone owns it.
        return True
    finally:
        probe.close()
    return True


def _clear_stale(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"control socket {path}: a file that is not a socket is in the way; not replacing it")
    if _probe(path):
        raise ConfigError(f"control socket {path} is in use by another running pool")
    log.info("removing stale control socket %s", path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def bind_private(path: Path) -> socket.socket:
    """A listening unix socket that is mode 0600 from the moment `path` names it."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _clear_stale(path)
        private = tempfile.mkdtemp(prefix=".lp", dir=path.parent)  # mode 0700
    except OSError as exc:
        raise ConfigError(f"control socket {path}: {exc.strerror or exc}") from exc
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        tmp = os.path.join(private, "s")
        sock.bind(tmp)
        os.chmod(tmp, 0o600)
        # A short backlog refuses (EAGAIN) clients that connect at the same
        # moment; the kernel caps this at net.core.somaxconn.
        sock.listen(socket.SOMAXCONN)
        # link(), unlike rename(), fails when the name exists: a pool that
        # started at the same moment keeps its socket.
        os.link(tmp, path)
    except FileExistsError:
        sock.close()
        raise ConfigError(f"control socket {path} was taken by another pool starting at the same time") from None
    except OSError as exc:
        sock.close()
        raise ConfigError(f"control socket {path}: cannot create it: {exc.strerror or exc}") from exc
    finally:
        shutil.rmtree(private, ignore_errors=True)
    sock.setblocking(False)
    return sock


# Generation requests a client may have running at once (`generate` op);
# the pool's own bounds (max_queued) apply as well.
MAX_CLIENT_REQUESTS = 64


class _Client:
    """One connection; also the sink of the requests it sent (`generate`)."""

    def __init__(self, writer: asyncio.StreamWriter, reserved: bool):
        self.writer = writer
        # Let in beyond max_control_clients: closed once quiet for the
        # request timeout (or the idle timeout, if shorter).
        self.reserved = reserved
        self.pending: set[asyncio.Task] = set()
        self.requests: set[str] = set()  # ids of its generate ops, maybe ended
        self.last_active = time.monotonic()

    def write(self, data: bytes) -> None:
        if self.writer.is_closing():
            return
        if self.writer.transport.get_write_buffer_size() > MAX_BACKLOG:
            log.warning("control client is not reading its events; dropping it")
            self.writer.close()
            return
        self.last_active = time.monotonic()
        self.writer.write(data)


class ControlServer:
    def __init__(self, path: Path, sock: socket.socket, max_clients: int = 32, idle_timeout: float | None = None, request_timeout: float = 10.0):
        self.pool: Pool | None = None
        self.path = path
        self.max_clients = max_clients
        self.idle_timeout = idle_timeout
        self.request_timeout = request_timeout
        self._sock = sock
        st = os.stat(path)
        self._identity = (st.st_dev, st.st_ino)
        self._accepting: asyncio.Task | None = None
        self._clients: set[_Client] = set()
        self._sessions: set[asyncio.Task] = set()

    @classmethod
    def bind(cls, config: Config) -> ControlServer | None:
        """Claims the configured socket path. An explicitly configured path
        that cannot be had is an error; the default one is only a
        convenience, so the pool then runs without it."""
        path = socket_path(config)
        if path is None:
            return None
        try:
            sock = bind_private(path)
        except ConfigError as exc:
            if config.control_socket is True:
                log.warning("%s; running without a control socket", exc)
                return None
            raise
        return cls(path, sock, config.max_control_clients, parse_duration(config.control_idle_timeout), parse_duration(config.control_request_timeout))

    async def start(self, pool: Pool) -> None:
        self.pool = pool
        self._accepting = asyncio.get_running_loop().create_task(self._accept())
        pool.output.add_tap(self._broadcast)
        log.info("control socket at %s", self.path)

    async def _accept(self) -> None:
        # Our own accept loop, not asyncio.start_unix_server: out of file
        # descriptors, CPython's (before gh-151615) schedules a retry per
        # failed accept, up to `backlog` of them per try, and floods stderr
        # with millions of tracebacks. Here: one line, one retry a second.
        loop = asyncio.get_running_loop()
        starved = False
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in RESOURCE_ERRNOS:
                    log.exception("control socket: accept failed")
                elif not starved:
                    log.warning("control socket: cannot accept connections (%s); retrying every %gs", exc.strerror, ACCEPT_RETRY_DELAY)
                starved = True
                await asyncio.sleep(ACCEPT_RETRY_DELAY)
                continue
            starved = False
            try:
                reader, writer = await asyncio.open_unix_connection(sock=conn)
            except Exception:
                log.exception("control socket: a new connection failed")
                conn.close()
                continue
            session = loop.create_task(self._session(reader, writer))
            self._sessions.add(session)
            session.add_done_callback(self._sessions.discard)

    def _broadcast(self, data: bytes) -> None:
        # Token lines (and blocks of them) are never lifecycle events.
        if not self._clients or event_name(data) == "gen_token":
            return
        for line in data.splitlines(keepends=True):
            if event_name(line) in LIFECYCLE:
                for client in list(self._clients):
                    client.write(line)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._clients) >= self.max_clients + CONTROL_RESERVE:
            # Every connection holds a descriptor: past the bound, refuse one
            # rather than let idle clients use up what workers need to start.
            log.warning(
                "control socket: %d clients connected (max_control_clients and %d kept for ps and stop); refusing another", len(self._clients), CONTROL_RESERVE
            )
            writer.write(encode_error(f"{len(self._clients)} control clients are connected (max_control_clients); try again later", OVERLOADED))
            writer.close()
            return
        client = _Client(writer, reserved=len(self._clients) >= self.max_clients)
        self._clients.add(client)
        splitter = LineSplitter(MAX_LINE)
        line_started: float | None = None
        try:
            while True:
                data = await self._read(reader, client, line_started)
                if data is None:
                    return
                had_partial = splitter.partial
                lines = splitter.feed(data) if data else splitter.finish()
                for line in lines:
                    self._dispatch(client, line)
                if not data:
                    break
                if not splitter.partial:
                    line_started = None
                elif lines or not had_partial:
                    line_started = time.monotonic()  # a new line began in this chunk
            # The client may half-close after its last op and still read:
            # replies still being measured are owed to it.
            if client.pending:
                await asyncio.wait(client.pending)
            await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception:
            log.exception("control socket: a connection failed; closing it")
        finally:
            self._clients.discard(client)
            for id_json in client.requests:
                self.pool.ops.cancel_for(id_json, client)
            writer.close()

    async def _read(self, reader: asyncio.StreamReader, client: _Client, line_started: float | None) -> bytes | None:
        """The next bytes from the client (b"" at EOF), or None once a time
        limit has passed: nothing went either way for the idle timeout, or
        the line begun at `line_started` is not whole within the request
        timeout (a client trickling bytes is not kept for ever)."""
        while True:
            idle = self.idle_timeout
            if client.reserved:
                idle = self.request_timeout if idle is None else min(idle, self.request_timeout)
            limits = [] if idle is None else [(client.last_active + idle, False)]
            if line_started is not None:
                limits.append((line_started + self.request_timeout, True))
            if not limits:
                return await reader.read(65536)
            at, late_line = min(limits)
            left = at - time.monotonic()
            if left <= 0:
                if late_line:
                    log.warning(
                        "control socket: closing a connection whose op line did not arrive whole within %gs (control_request_timeout)", self.request_timeout
                    )
                    client.write(
                        encode_error(
                            f"an op line must arrive whole within {self.request_timeout:g}s of its first byte (control_request_timeout); closing the connection",
                            BAD_REQUEST,
                        )
                    )
                else:
                    log.info(
                        "control socket: closing a connection idle for %gs (%s)",
                        idle,
                        "control_request_timeout" if idle == self.request_timeout else "control_idle_timeout",
                    )
                return None
            try:
                data = await asyncio.wait_for(reader.read(65536), left)
            except TimeoutError:
                continue
            client.last_active = time.monotonic()
            return data

    def _dispatch(self, client: _Client, line) -> None:
        id_json = None
        try:
            msg = read_line(line, MAX_LINE)
            if msg is None:
                return
            id_json = msg.id_json
            if msg.op is None:
                client.write(
                    encode_error('a generation request on the control socket is an op: {"op":"generate", ...}; or send it on stdin', BAD_REQUEST, id_json)
                )
                return
            if msg.op in REQUEST_OPS:
                self._generate(client, msg)
                return
            task = self.pool.ops.op(msg, client.write)
        except BadRequest as exc:
            client.write(encode_error(exc.msg, BAD_REQUEST, exc.id_json))
            return
        except Exception as exc:
            log.exception("control socket line failed: %r", line[:200] if isinstance(line, bytes) else line)
            client.write(encode_error(internal_error("this line", exc), INTERNAL, id_json))
            return
        if task is not None:
            client.pending.add(task)
            task.add_done_callback(client.pending.discard)

    def _generate(self, client: _Client, msg) -> None:
        """A generation request whose lines go back to this client alone (the
        lifecycle lines of its model reach it as they reach every client);
        cancelled if the client goes away first."""
        if len(client.requests) >= MAX_CLIENT_REQUESTS:
            client.requests = {i for i in client.requests if self.pool.ops.runs_for(i, client)}
        if len(client.requests) >= MAX_CLIENT_REQUESTS:
            client.write(encode_error(f"{MAX_CLIENT_REQUESTS} requests of this connection are running; wait for one to end", OVERLOADED, msg.id_json))
            return
        client.requests.add(msg.id_json)
        self.pool.submit(msg, client)

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        self._sock.close()
        for client in list(self._clients):
            client.writer.close()
        for session in list(self._sessions):
            session.cancel()
        if self._sessions:
            await asyncio.wait(self._sessions, timeout=5)
        self._unlink_if_ours()

    def _unlink_if_ours(self) -> None:
        # A later pool may already own the name (ours was removed as stale).
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._identity:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
