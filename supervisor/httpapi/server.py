"""The HTTP surface: uvicorn on the pool's own event loop, a small ASGI app.

uvicorn (with h11) is the HTTP stack; the app is ours: five routes need no
framework, and the disconnect of a client must cancel its request at once,
which we get by waiting on ASGI's `http.disconnect` beside every response
(docs/http.md says why uvicorn, and not aiohttp or Starlette).

Bounds (config keys, docs/http.md): at most `max_http_connections` open
connections (one more is answered 429 and closed at once), a connection
with no request for `http_idle_timeout` is closed (before its first
request and between any two), a request's head and body must arrive
whole within `http_request_timeout` of its first byte (408), a request
head of at most 64 KiB (h11), a body of at most `max_http_body_bytes`
(413), and per stream `http_stream_buffer` bytes not yet taken by the
client (supervisor.httpapi.exchange).

Without an API key the pool listens on loopback only, and what a web page
could make a browser send there is refused (403): a `Host` that is not
this machine's (DNS rebinding), an `Origin` not in `http_allowed_origins`,
a body that is not `application/json` (a "simple" cross-site POST).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

import h11
import msgspec
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ipc.events import BAD_REQUEST, INTERNAL, OVERLOADED, UNKNOWN_MODEL
from supervisor.config import Config, ConfigError, parse_duration, parse_size, split_address
from supervisor.httpapi import anthropic, embeddings, ollama, responses
from supervisor.httpapi.choices import Choices
from supervisor.httpapi.exchange import Exchange
from supervisor.httpapi.models import chat_template, list_models, model_name, one_model
from supervisor.httpapi.shapes import CountReply, HttpError, Reply, chat_request, completion_request, error_body, json_object
from supervisor.httpapi.tools import ToolReader
from supervisor.pool import Pool
from supervisor.requests import ClientLine
from supervisor.resolve import UnknownModel

log = logging.getLogger("lattice.http")

API_KEY_ENV = "LATTICE_API_KEY"
MAX_HEAD_BYTES = 64 * 1024
# After the pool has stopped, how long responses may take to reach their
# clients before the connections left are dropped.
CLOSE_GRACE = 5.0
CONNECTION = "lattice.connection"  # the key of a request's Connection in scope["state"]
# Set in a request's scope once the pool has it: its errors are then the
# pool's, counted there (lattice_errors_total); those before are counted here.
_POOL_ANSWERS = "lattice.pool_answers"
JSON = (b"content-type", b"application/json")


def _ignore(line: bytes) -> None:
    pass


class _ClientGone(Exception):
    pass


# -- connections -----------------------------------------------------------------


class Connection(H11Protocol):
    """uvicorn's h11 protocol with our bounds: a connection count, a time
    limit on each wait for the client, and `abort` for a stream whose
    reader fell too far behind.

    uvicorn times out only a keep-alive connection that sends nothing at
    all, and stops counting at its first byte: a request trickled a byte
    at a time held a connection for ever. Here one timer follows each
    connection through its requests: idle (no byte of a request yet) for
    at most idle_timeout, receiving (a request begun, not yet whole: its
    head, then its body) until request_deadline, then serving, unbounded
    (a long answer streams), and idle again."""

    max_connections = 0
    idle_timeout = 0.0
    request_timeout = 0.0
    send_buffer = 0
    refusal = b""
    too_slow = b""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # scope["state"] is a copy of app_state per request: a request finds
        # its own connection there.
        self.app_state = {**self.app_state, CONNECTION: self}
        self._timer: asyncio.TimerHandle | None = None
        self._phase = ""
        # Loop time by which the request being received must be whole; the
        # app reads its body against it. None while idle or serving.
        self.request_deadline: float | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning("http: %d connections open (max_http_connections); refusing one more", self.max_connections)
            transport.write(self.refusal)
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Linux grows a connection's send buffer up to 4 MiB on its own
            # (tcp_wmem): bounded, that is the kernel's share of what a
            # client that does not read can make us hold.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer)
        self._follow()

    def handle_events(self) -> None:
        super().handle_events()
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def _follow(self) -> None:
        """Sets the timer for where the connection now stands (h11 says)."""
        if self.transport.is_closing():
            return
        theirs = self.conn.their_state
        if theirs is h11.IDLE and not self.conn.trailing_data[0]:
            if self._phase != "idle":
                self._phase, self.request_deadline = "idle", None
                self._arm(self.idle_timeout, self._idle)
        elif theirs in (h11.IDLE, h11.SEND_BODY):
            if self._phase != "receiving":
                self._phase, self.request_deadline = "receiving", self.loop.time() + self.request_timeout
                self._arm(self.request_timeout, self._late)
        elif self._phase != "serving":
            self._phase, self.request_deadline = "serving", None
            self._arm(None, None)

    def _arm(self, delay: float | None, callback) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None if delay is None else self.loop.call_later(delay, callback)

    def _idle(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _late(self) -> None:
        """The request being received is not whole by its deadline."""
        self._timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if self.conn.their_state is h11.SEND_BODY and cycle is not None and not cycle.response_started:
            # The app is reading this body against the same deadline and
            # answers 408 itself.
            return
        if self.conn.their_state is h11.IDLE and (cycle is None or cycle.response_complete):
            self.transport.write(self.too_slow)  # the head never came whole
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None, None)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        # uvicorn answers what h11 cannot parse (a head over 64 KiB, not
        # HTTP at all) in plain text; ours is in OpenAI's shape too.
        body = error_body(f"invalid HTTP request: {msg}", "invalid_request_error", BAD_REQUEST)
        self.transport.write(
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()

    def abort(self) -> None:
        self.transport.abort()


def _closing_answer(status: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (status, len(body), body)


def connection_class(config: Config) -> type[Connection]:
    limit = config.max_http_connections
    request_timeout = parse_duration(config.http_request_timeout)
    busy = error_body(f"{limit} HTTP connections are open (max_http_connections); try again later", "rate_limit_error", OVERLOADED)
    slow = error_body(f"the request did not arrive whole within {request_timeout:g}s (http_request_timeout)", "invalid_request_error", "request_timeout")
    settings = {
        "max_connections": limit,
        "idle_timeout": parse_duration(config.http_idle_timeout),
        "request_timeout": request_timeout,
        "send_buffer": parse_size(config.http_stream_buffer),
        "refusal": _closing_answer(b"429 Too Many Requests", busy),
        "too_slow": _closing_answer(b"408 Request Timeout", slow),
    }
    return type("BoundedConnection", (Connection,), settings)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # SIGTERM and SIGINT belong to the pool (supervisor.lifecycle);
        # uvicorn's handlers would replace the pool's.
        yield


# -- the listening socket ----------------------------------------------------------


def listen(address: str, api_key: str | None) -> socket.socket:
    """A bound, listening socket; ConfigError for a host that is not
    loopback without an API key, or an address that cannot be had."""
    host, port = split_address(address)
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"http {address}: cannot resolve {host!r}: {exc.strerror}") from exc
    if not ipaddress.ip_address(sockaddr[0]).is_loopback and not api_key:
        raise ConfigError(
            f"http {address}: {sockaddr[0]} is not a loopback address; serving other machines needs an API key (api_key, --api-key or ${API_KEY_ENV})"
        )
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"http {address}: cannot listen: {exc.strerror or exc}") from exc
    return sock


def api_key_of(config: Config) -> str | None:
    """api_key, else $LATTICE_API_KEY (set but empty: no key). A key of
    blanks would guard nothing; spaces around one can never be sent."""
    key = config.api_key if config.api_key is not None else os.environ.get(API_KEY_ENV, "")
    if key and not key.strip():
        raise ConfigError(f"the API key (${API_KEY_ENV}) is blank: give a key, or unset it")
    return key.strip() or None


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


# -- the app --------------------------------------------------------------------------


async def _send_json(send, status: int, body: bytes, *headers: tuple[bytes, bytes]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [JSON, (b"content-length", b"%d" % len(body)), *headers]})
    await send({"type": "http.response.body", "body": body})


async def _read_body(scope: dict, receive, limit: int, timeout: float) -> bytes:
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise HttpError(413, f"request body is {int(value)} bytes; the limit is {limit} (max_http_body_bytes)", code="request_too_large")
    connection: Connection | None = scope.get("state", {}).get(CONNECTION)
    loop = asyncio.get_running_loop()
    body = bytearray()
    while True:
        # uvicorn waits for a body without a bound; the whole request has
        # one deadline, however it trickles (None: it has all arrived).
        deadline = connection.request_deadline if connection is not None else None
        try:
            message = await asyncio.wait_for(receive(), None if deadline is None else max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise HttpError(408, f"the request did not arrive whole within {timeout:g}s (http_request_timeout)", code="request_timeout") from None
        if message["type"] == "http.disconnect":
            raise _ClientGone()
        body += message.get("body", b"")
        if len(body) > limit:
            raise HttpError(413, f"request body is over {limit} bytes (max_http_body_bytes)", code="request_too_large")
        if not message.get("more_body"):
            return bytes(body)


async def _disconnected(receive) -> None:
    """Returns when the client has gone (or the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _header(scope: dict, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key == name), None)


def _host_name(host: bytes) -> str:
    """The name in a Host header: no port, no brackets, no final dot."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        text = text[1 : text.find("]")] if "]" in text else text[1:]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    return text.rstrip(".")


def _forbidden(message: str, code: str) -> HttpError:
    return HttpError(403, message, "permission_error", code)


class App:
    """The ASGI application: routes, the API key or the browser guard,
    errors in OpenAI's shape."""

    def __init__(self, pool: Pool, config: Config, api_key: str | None, local_names: set[str]):
        self.pool = pool
        self.api_key = api_key.encode() if api_key else None
        self.max_body = parse_size(config.max_http_body_bytes)
        self.stream_buffer = parse_size(config.http_stream_buffer)
        self.request_timeout = parse_duration(config.http_request_timeout)
        self.allowed_origins = frozenset(config.http_allowed_origins)
        # Host names that mean this pool: "localhost" and the address it
        # listens on, as configured and as bound.
        self.local_names = {"localhost", *local_names}
        # Other APIs on the same pool, by route: each reads its body as a chat
        # request and writes its own answers and errors.
        self.apis = {
            "/v1/responses": responses,
            "/v1/messages": anthropic,
            "/v1/messages/count_tokens": anthropic,
            "/v1/responses/input_tokens": responses,
            "/api/chat": ollama.CHAT,
            "/api/generate": ollama.GENERATE,
        }
        self.stored = responses.ResponseStore()

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http":
            return
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            if self.api_key is None:
                self._guard(scope)
            else:
                self._authorize(scope)
            await self._route(scope, receive, tracked)
        except HttpError as exc:
            if not scope.get(_POOL_ANSWERS):
                # Refused before the pool saw it (the pool counts its own).
                self.pool.note_error(None, exc.code or f"http_{exc.status}", "http")
            if not started:
                extra = [(b"www-authenticate", b"Bearer")] if exc.status == 401 else []
                if exc.status in (408, 413):
                    # The rest of the body is not wanted: do not wait for it.
                    extra.append((b"connection", b"close"))
                await _send_json(send, exc.status, self._error_body(scope, exc), *extra)
        except _ClientGone:
            pass
        except Exception:
            log.exception("http: %s %s failed", scope.get("method"), scope.get("path"))
            self.pool.note_error(None, INTERNAL, "http")
            if not started:
                error = HttpError(500, "internal error; the pool logged it and goes on", "server_error", INTERNAL)
                await _send_json(send, 500, self._error_body(scope, error))

    def _error_body(self, scope: dict, error: HttpError) -> bytes:
        """`error` in the shape of the API the path belongs to (OpenAI's by
        default): every /api/ path is Ollama's, whose clients read
        {"error": "..."}."""
        path = scope.get("path", "")
        api = self.apis.get(path) or (ollama if path.startswith("/api/") else None)
        return (api.error(error) if api is not None else error).body()

    def _guard(self, scope: dict) -> None:
        """Without a key, any program on this machine may call the pool, but
        no web page: a page can make a browser send requests here, and with
        DNS rebinding read the answers. Browsers always send Host and, for
        a request from another site, Origin."""
        host = _header(scope, b"host")
        if host is not None and not self._is_local(host):
            raise _forbidden(
                f"Host {host.decode('latin-1')[:100]!r} does not name this machine; a pool without an API key answers only requests addressed to localhost or the address it listens on",
                "forbidden_host",
            )
        origin = _header(scope, b"origin")
        if origin is not None and origin.decode("latin-1") not in self.allowed_origins:
            raise _forbidden(
                f"requests from web pages (Origin {origin.decode('latin-1')[:100]!r}) are refused by a pool without an API key; allow an origin with http_allowed_origins",
                "forbidden_origin",
            )

    def _is_local(self, host: bytes) -> bool:
        name = _host_name(host)
        if name in self.local_names:
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False

    def _json_body(self, scope: dict) -> None:
        """A JSON route's body must say it is JSON: a page may POST text/plain
        (or a type-less blob) to any site without asking the browser first."""
        if self.api_key is not None:
            return
        given = _header(scope, b"content-type") or b""
        if given.partition(b";")[0].strip().lower() != b"application/json":
            shown = given.decode("latin-1")[:100] or "none"
            raise _forbidden(f"content-type {shown!r}: a pool without an API key takes only 'application/json' bodies", "forbidden_content_type")

    def _authorize(self, scope: dict) -> None:
        given = _header(scope, b"authorization")
        if given is None:
            # Anthropic's clients send the key as x-api-key.
            key = next((value for name, value in scope["headers"] if name == b"x-api-key"), None)
            if key is None:
                raise HttpError(401, "missing API key: send it as 'Authorization: Bearer KEY' (or 'x-api-key: KEY')", code="missing_api_key")
            given = b"Bearer " + key
        scheme, _, key = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
            raise HttpError(401, "incorrect API key", code="invalid_api_key")

    async def _route(self, scope: dict, receive, send) -> None:
        method, path = scope["method"], scope["path"]
        routes = {
            "/health": ("GET", self._health),
            "/v1/models": ("GET", self._models),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/completions": ("POST", self._completions),
            "/v1/responses": ("POST", self._other_api),
            "/v1/messages": ("POST", self._other_api),
            "/v1/messages/count_tokens": ("POST", self._count_tokens),
            "/v1/responses/input_tokens": ("POST", self._count_tokens),
            "/api/chat": ("POST", self._other_api),
            "/api/generate": ("POST", self._other_api),
            "/api/tags": ("GET", self._ollama_info),
            "/api/ps": ("GET", self._ollama_info),
            "/api/version": ("GET", self._ollama_info),
            "/api/show": ("POST", self._ollama_info),
            "/v1/embeddings": ("POST", self._embeddings),
            "/api/embed": ("POST", self._embeddings),
            "/api/embeddings": ("POST", self._embeddings),
        }
        if path.startswith("/v1/models/"):
            routes[path] = ("GET", self._model)
        if path not in routes:
            raise HttpError(404, f"no route {path}; see docs/http.md", code="not_found")
        want, handler = routes[path]
        if method != want:
            raise HttpError(405, f"{path} takes {want}, not {method}", code="method_not_allowed")
        await handler(scope, receive, send)

    # -- information --------------------------------------------------------------

    async def _health(self, scope, receive, send) -> None:
        if self.pool.accepting:
            await _send_json(send, 200, b'{"status":"ok"}')
        else:
            await _send_json(send, 503, b'{"status":"shutting_down"}')

    async def _models(self, scope, receive, send) -> None:
        await _send_json(send, 200, msgspec.json.encode({"object": "list", "data": await list_models(self.pool)}))

    async def _model(self, scope, receive, send) -> None:
        await _send_json(send, 200, msgspec.json.encode(one_model(self.pool, scope["path"].removeprefix("/v1/models/"))))

    def _model_name(self, value: object) -> str:
        return model_name(self.pool, value)

    def _opens_think(self, msg: ClientLine) -> bool:
        """Whether the reply starts inside <think>: the worker's ready line says."""
        try:
            spec = self.pool.resolve(msg.model, msg.lora)
        except UnknownModel:
            return False
        return self.pool.model_state(spec).opens_think

    # -- generation -----------------------------------------------------------------

    async def _chat(self, scope, receive, send) -> None:
        def parse(body: bytes, request_id: str):
            return chat_request(json_object(body), request_id, self._model_name, lambda name: chat_template(self.pool, name))

        await self._generate(scope, receive, send, "chatcmpl-", parse, Reply.maker(True))

    async def _completions(self, scope, receive, send) -> None:
        def parse(body: bytes, request_id: str):
            return completion_request(json_object(body), request_id, self._model_name)

        await self._generate(scope, receive, send, "cmpl-", parse, Reply.maker(False))

    async def _other_api(self, scope, receive, send) -> None:
        """/v1/responses and /v1/messages: their bodies read as a chat's, their
        answers in their own shapes (supervisor.httpapi.responses, .anthropic)."""
        api = self.apis[scope["path"]]
        parsed = []

        def parse(body: bytes, request_id: str):
            parsed.append(api.request(body, request_id, self._model_name, lambda name: chat_template(self.pool, name), self))
            return parsed[0]

        try:
            await self._generate(scope, receive, send, api.PREFIX, parse, api.reply_maker(self))
        except HttpError as exc:
            raise api.error(exc) from None
        except ollama.Unload as unload:
            try:
                spec = self.pool.resolve(unload.model, paths=False)
            except UnknownModel as exc:
                raise api.error(HttpError(404, str(exc), code=UNKNOWN_MODEL, param="model")) from None
            # Its `unloaded` line goes to stdout as any unload's; a model not
            # running has nothing to unload and says so to no one.
            self.pool.unload(spec, "unloaded by an Ollama request (keep_alive 0)", answer=_ignore)
            await _send_json(send, 200, ollama.unloaded_body(unload.model, unload.generate))
        finally:
            if parsed and hasattr(api, "after"):
                api.after(self, *parsed[0])

    async def _count_tokens(self, scope, receive, send) -> None:
        """Anthropic's /v1/messages/count_tokens and OpenAI's
        /v1/responses/input_tokens: the body read as that API's request, its
        prompt rendered and tokenized by the model's worker (the `count`
        op), nothing generated."""
        api = self.apis[scope["path"]]

        def parse(body: bytes, request_id: str):
            msg, opts = api.request(body, request_id, self._model_name, lambda name: chat_template(self.pool, name), self)
            msg.op = "count"
            opts.stream, opts.n = False, 1
            return msg, opts

        try:
            await self._generate(scope, receive, send, api.PREFIX, parse, CountReply.maker(api.counted))
        except HttpError as exc:
            raise api.error(exc) from None

    async def _ollama_info(self, scope, receive, send) -> None:
        body = b""
        if scope["method"] == "POST":
            self._json_body(scope)
            body = await _read_body(scope, receive, self.max_body, self.request_timeout)
        try:
            answer = await ollama.info(self, scope["path"], body)
        except HttpError as exc:
            raise ollama.error(exc) from None
        await _send_json(send, 200, answer)

    async def _embeddings(self, scope, receive, send) -> None:
        """/v1/embeddings, and Ollama's /api/embed and /api/embeddings (their
        errors in Ollama's shape): one `embed` request to the pool."""
        path = scope["path"]
        try:
            self._json_body(scope)
            body = await _read_body(scope, receive, self.max_body, self.request_timeout)
            request_id = "embd-" + secrets.token_hex(12)
            if path == "/v1/embeddings":
                msg, request = embeddings.openai_request(body, request_id, self._model_name)
            else:
                msg, request = embeddings.ollama_request(body, request_id, self._model_name, legacy=path == "/api/embeddings")
            vectors = embeddings.Vectors(request_id, request.count)
            self.pool.submit(msg, vectors, surface="http")
            scope[_POOL_ANSWERS] = True
            gone = asyncio.ensure_future(_disconnected(receive))
            gone.add_done_callback(lambda _: vectors.changed.set())
            try:
                while not vectors.ended and not gone.done():
                    vectors.changed.clear()
                    await vectors.changed.wait()
            finally:
                gone.cancel()
                if not vectors.ended:
                    self.pool.cancel(msg.id_json, _ignore)  # the client left
            if request.keep_alive is not False:
                with contextlib.suppress(UnknownModel):  # its path broke meanwhile
                    self.pool.keep_alive(self.pool.resolve(msg.model), request.keep_alive)
            if not vectors.ended:
                return
            if vectors.error is not None:
                raise vectors.error
            answer = embeddings.answer(request, vectors)
        except HttpError as exc:
            raise (exc if path == "/v1/embeddings" else ollama.error(exc)) from None
        await _send_json(send, 200, answer)

    async def _generate(self, scope: dict, receive, send, prefix: str, parse, make_reply) -> None:
        self._json_body(scope)
        body = await _read_body(scope, receive, self.max_body, self.request_timeout)
        request_id = prefix + secrets.token_hex(12)
        msg, opts = parse(body, request_id)
        chat = make_reply.chat
        # n > 1: one row per choice, each with an id (and seed) of its own.
        msgs = [msg] + [
            msgspec.structs.replace(msg, id=f"{request_id}-{i}", seed=None if msg.seed is None else (msg.seed + i) % 2**63) for i in range(1, opts.n)
        ]
        connection: Connection | None = scope.get("state", {}).get(CONNECTION)
        loop = asyncio.get_running_loop()
        cancelled = False

        def cancel() -> None:
            nonlocal cancelled
            if not cancelled and not exchange.ended:
                cancelled = True
                for row, part in zip(msgs, parts):
                    if not part.ended or part.error is not None:
                        self.pool.cancel(row.id_json, _ignore)

        def overflow() -> None:
            # Called from the pool's write into the exchange: act after it.
            log.warning(
                "http: request %s: the client read nothing for %d bytes (http_stream_buffer); cancelled, connection dropped", request_id, self.stream_buffer
            )
            loop.call_soon(cancel)
            if connection is not None:
                loop.call_soon(connection.abort)

        def fault(id_json: str | None) -> Callable[[], None]:
            # The exchange has ended itself: stop the row whatever it says.
            return lambda: loop.call_soon(self.pool.cancel, id_json, _ignore)

        created = int(time.time())
        parts = []
        for i, row in enumerate(msgs):
            reply = make_reply(request_id, created, opts, i)
            tools = ToolReader(opts.tools, opts.tool_format) if opts.tools is not None else None
            think = (lambda: self._opens_think(msg)) if chat else None
            parts.append(Exchange(reply, opts.stream, self.stream_buffer, think, overflow, fault(row.id_json), tools, opts.logprobs is not None))
        exchange = parts[0] if opts.n == 1 else Choices(parts, reply)
        for row, part in zip(msgs, parts):
            self.pool.submit(row, part, surface="http")
        scope[_POOL_ANSWERS] = True
        gone = asyncio.ensure_future(_disconnected(receive))
        gone.add_done_callback(lambda _: exchange.changed.set())
        try:
            if opts.stream:
                await self._stream(exchange, send, gone)
            else:
                await self._answer(exchange, send, gone)
        finally:
            gone.cancel()
            # A client that left (or fell too far behind) takes its row out
            # of the batch now, not when the model would have finished.
            cancel()

    async def _answer(self, exchange: Exchange, send, gone: asyncio.Future) -> None:
        while not exchange.ended and not gone.done():
            exchange.changed.clear()
            await exchange.changed.wait()
        if not exchange.ended:
            return
        if exchange.error is not None:
            raise exchange.error
        await _send_json(send, 200, exchange.whole())

    async def _stream(self, exchange: Exchange, send, gone: asyncio.Future) -> None:
        headers_sent = False
        while True:
            await exchange.changed.wait()
            if gone.done() or exchange.overflowed:
                return
            if not headers_sent:
                if not exchange.started:
                    if exchange.error is not None:
                        raise exchange.error  # before the first token: a plain HTTP error
                    exchange.changed.clear()
                    continue
                await send({"type": "http.response.start", "status": 200, "headers": exchange.headers})
                headers_sent = True
            ended = exchange.ended
            data = exchange.take()
            await send({"type": "http.response.body", "body": data, "more_body": not ended})
            if ended:
                return


# -- the server -------------------------------------------------------------------------


class HttpServer:
    def __init__(self, server: _Server, task: asyncio.Task, url: str):
        self.server = server
        self.task = task
        self.url = url

    @classmethod
    async def start(cls, pool: Pool, config: Config) -> HttpServer:
        api_key = api_key_of(config)
        sock = listen(config.http, api_key)
        app = App(pool, config, api_key, {split_address(config.http)[0].lower(), sock.getsockname()[0]})
        uv = uvicorn.Config(
            app,
            http=connection_class(config),
            ws="none",
            lifespan="off",
            interface="asgi3",
            log_config=None,
            access_log=False,
            server_header=False,
            proxy_headers=False,
            timeout_keep_alive=parse_duration(config.http_idle_timeout),
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        )
        # uvicorn says "Started server process" and the like at INFO.
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
        server = _Server(uv)
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        url = url_of(sock)
        log.info("http on %s/v1 (%s)", url, "API key required" if api_key else "no API key")
        return cls(server, task, url)

    async def close(self) -> None:
        """After the pool has stopped: lets the last responses go out, then
        drops what is left."""
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), CLOSE_GRACE)
        except TimeoutError:
            for connection in list(self.server.server_state.connections):
                connection.transport.abort()
            await self.task
