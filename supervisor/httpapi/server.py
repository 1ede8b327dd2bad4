"""The HTTP surface: uvicorn on the pool's own event loop, a small ASGI app.

uvicorn (with h11) is the HTTP stack; the app is ours: five routes need no
framework, and the disconnect of a client must cancel its request at once,
which we get by waiting on ASGI's `http.disconnect` beside every response
(docs/http.md says why uvicorn, and not aiohttp or Starlette).

Bounds (config keys, docs/http.md): at most `max_http_connections` open
connections (one more is answered 429 and closed at once), a connection
with no request for `http_idle_timeout` is closed, a request head of at
most 64 KiB (h11), a body of at most `max_http_body_bytes` (413), and
per stream `http_stream_buffer` bytes not yet taken by the client
(supervisor.httpapi.exchange).
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
from typing import Any, Callable

import msgspec
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ipc.events import BAD_REQUEST, INTERNAL, OVERLOADED
from supervisor.config import Config, ConfigError, parse_duration, parse_size, split_address
from supervisor.httpapi import anthropic, ollama, responses
from supervisor.httpapi.choices import Choices
from supervisor.httpapi.exchange import Exchange
from supervisor.httpapi.models import chat_template, list_models, model_name, one_model
from supervisor.httpapi.shapes import HttpError, Reply, chat_request, completion_request, error_body
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
JSON = (b"content-type", b"application/json")


def _ignore(line: bytes) -> None:
    pass


class _ClientGone(Exception):
    pass


# -- connections -----------------------------------------------------------------


class Connection(H11Protocol):
    """uvicorn's h11 protocol with our bounds: a connection count, a first
    request within the idle timeout (uvicorn times out only idle keep-alive
    connections), and `abort` for a stream whose reader fell too far behind."""

    max_connections = 0
    idle_timeout = 0.0
    send_buffer = 0
    refusal = b""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # scope["state"] is a copy of app_state per request: a request finds
        # its own connection there.
        self.app_state = {**self.app_state, CONNECTION: self}
        self._first_request: asyncio.TimerHandle | None = None

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
        self._first_request = self.loop.call_later(self.idle_timeout, self._idle)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and self._first_request is not None:
            self._first_request.cancel()
            self._first_request = None

    def _idle(self) -> None:
        self._first_request = None
        if self.cycle is None and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._first_request is not None:
            self._first_request.cancel()
            self._first_request = None
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        # uvicorn answers what h11 cannot parse (a head over 64 KiB, not
        # HTTP at all) in plain text; ours is in OpenAI's shape too.
        body = error_body(f"invalid HTTP request: {msg}", "invalid_request_error", BAD_REQUEST)
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def abort(self) -> None:
        self.transport.abort()


def connection_class(config: Config) -> type[Connection]:
    limit = config.max_http_connections
    body = error_body(f"{limit} HTTP connections are open (max_http_connections); try again later", "rate_limit_error", OVERLOADED)
    refusal = b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
    settings = {
        "max_connections": limit,
        "idle_timeout": parse_duration(config.http_idle_timeout),
        "send_buffer": parse_size(config.http_stream_buffer),
        "refusal": refusal,
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
    body = bytearray()
    while True:
        try:
            message = await asyncio.wait_for(receive(), timeout)
        except asyncio.TimeoutError:
            # uvicorn waits for a body without a bound; a trickle must not hold a connection.
            raise HttpError(408, f"no more of the request body came for {timeout:g}s (http_idle_timeout)", code="request_timeout") from None
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


class App:
    """The ASGI application: routes, the API key, errors in OpenAI's shape."""

    def __init__(self, pool: Pool, config: Config, api_key: str | None):
        self.pool = pool
        self.api_key = api_key.encode() if api_key else None
        self.max_body = parse_size(config.max_http_body_bytes)
        self.stream_buffer = parse_size(config.http_stream_buffer)
        self.idle_timeout = parse_duration(config.http_idle_timeout)
        # Other APIs on the same pool, by route: each reads its body as a chat
        # request and writes its own answers and errors.
        self.apis = {"/v1/responses": responses, "/v1/messages": anthropic, "/api/chat": ollama.CHAT, "/api/generate": ollama.GENERATE}
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
            self._authorize(scope)
            await self._route(scope, receive, tracked)
        except HttpError as exc:
            if not started:
                extra = [(b"www-authenticate", b"Bearer")] if exc.status == 401 else []
                api = self.apis.get(scope.get("path", ""))
                await _send_json(send, exc.status, (api.error(exc) if api is not None else exc).body(), *extra)
        except _ClientGone:
            pass
        except Exception:
            log.exception("http: %s %s failed", scope.get("method"), scope.get("path"))
            if not started:
                error = HttpError(500, "internal error; the pool logged it and goes on", "server_error", INTERNAL)
                api = self.apis.get(scope.get("path", ""))
                await _send_json(send, 500, (api.error(error) if api is not None else error).body())

    def _authorize(self, scope: dict) -> None:
        if self.api_key is None:
            return
        given = next((value for name, value in scope["headers"] if name == b"authorization"), None)
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
            "/api/chat": ("POST", self._other_api),
            "/api/generate": ("POST", self._other_api),
            "/api/tags": ("GET", self._ollama_info),
            "/api/ps": ("GET", self._ollama_info),
            "/api/version": ("GET", self._ollama_info),
            "/api/show": ("POST", self._ollama_info),
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
            spec = self.pool.resolver.resolve(msg.model, msg.lora)
        except UnknownModel:
            return False
        slot = self.pool.slots.get(spec.key)
        return slot is not None and slot.opens_think

    # -- generation -----------------------------------------------------------------

    async def _chat(self, scope, receive, send) -> None:
        def parse(body: bytes, request_id: str):
            return chat_request(body, request_id, self._model_name, lambda name: chat_template(self.pool, name))

        await self._generate(scope, receive, send, "chatcmpl-", parse, Reply.maker(True))

    async def _completions(self, scope, receive, send) -> None:
        def parse(body: bytes, request_id: str):
            return completion_request(body, request_id, self._model_name)

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
        finally:
            if parsed and hasattr(api, "after"):
                api.after(self, *parsed[0])

    async def _ollama_info(self, scope, receive, send) -> None:
        body = await _read_body(scope, receive, self.max_body, self.idle_timeout) if scope["method"] == "POST" else b""
        try:
            answer = await ollama.info(self, scope["path"], body)
        except HttpError as exc:
            raise ollama.error(exc) from None
        await _send_json(send, 200, answer)

    async def _generate(self, scope: dict, receive, send, prefix: str, parse, make_reply) -> None:
        body = await _read_body(scope, receive, self.max_body, self.idle_timeout)
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
            log.warning("http: request %s: the client read nothing for %d bytes (http_stream_buffer); cancelled, connection dropped", request_id, self.stream_buffer)
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
            parts.append(Exchange(reply, opts.stream, self.stream_buffer, think, overflow, fault(row.id_json), tools))
        exchange = parts[0] if opts.n == 1 else Choices(parts, reply)
        for row, part in zip(msgs, parts):
            self.pool.submit(row, part, surface="http")
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
    async def start(cls, pool: Pool, config: Config) -> "HttpServer":
        api_key = config.api_key or os.environ.get(API_KEY_ENV) or None
        sock = listen(config.http, api_key)
        app = App(pool, config, api_key)
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
        except asyncio.TimeoutError:
            for connection in list(self.server.server_state.connections):
                connection.transport.abort()
            await self.task
