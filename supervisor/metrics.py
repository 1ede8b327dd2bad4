"""Prometheus metrics on 127.0.0.1, from a server thread of our own.

Counters and histograms are fed by the pool on the event loop (they are
thread-safe). Per-model gauges are measured when scraped: the scrape thread
asks the event loop for the same figures as the `status` op, so a scrape
shows what the workers report now, and a model that was unloaded has no
gauge series any more. Names and labels: docs/monitoring.md.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import importlib.metadata
import io
import logging
import platform
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client
import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ipc.events import ADAPTER_ERROR
from ipc.worker_events import Done
from supervisor.child import RESOURCE_ERRNOS
from supervisor.config import ConfigError
from supervisor.pool import Pool
from supervisor.ps import by_worker
from supervisor.spec import ModelSpec
from supervisor.states import State
from supervisor.status import Status

log = logging.getLogger("lattice.metrics")

# status_fields waits at most 2 s for a worker's stats reply; a scrape that
# still gets nothing (the loop is wedged or gone) shows counters only.
SCRAPE_TIMEOUT = 5.0
LABELS = ("model", "adapter")

# Figures of a worker process, once per worker: labelled by the name it
# serves without adapter (its first name otherwise; as `ps` lists it first)
# and its pid, so that sum() over them counts each process once.
WORKER_LABELS = ("model", "pid")
# StatusRow field -> (metric name, help)
WORKER_GAUGES = {
    "rss_bytes": ("lattice_worker_rss_bytes", "Resident set size of the worker process"),
    "uss_bytes": ("lattice_worker_uss_bytes", "Unique set size of the worker process (memory freed if it exits)"),
    "mlx_active_bytes": ("lattice_worker_mlx_active_bytes", "MLX active memory in the worker"),
    "mlx_peak_bytes": ("lattice_worker_mlx_peak_bytes", "MLX peak memory in the worker since it started"),
    "mlx_cache_bytes": ("lattice_worker_mlx_cache_bytes", "MLX buffer cache in the worker"),
    "weights_bytes": ("lattice_worker_weights_bytes", "Bytes of model weights loaded in the worker"),
    "uptime_s": ("lattice_worker_uptime_seconds", "Seconds since the worker process started"),
    "max_batch": ("lattice_worker_max_batch", "Requests the worker may decode together"),
    "active_rows": ("lattice_worker_active_rows", "Requests the worker is decoding (its batch rows)"),
    "waiting_rows": ("lattice_worker_waiting_rows", "Requests sent to the worker that wait for room in its batch"),
    "rows_cache_bytes": ("lattice_worker_rows_cache_bytes", "Bytes of the model state (caches) of the worker's batch rows"),
    "max_adapters": ("lattice_worker_max_adapters", "Adapters the worker may keep in memory"),
    "device_memory_bytes": ("lattice_worker_device_memory_bytes", "Memory of the device the worker computes on (the GPU's on CUDA)"),
}
# Figures that differ between the names of one worker.
NAME_GAUGES = {
    "adapter_bytes": ("lattice_model_adapter_bytes", "Bytes of this name's LoRA adapter in the worker's memory (0 when not resident)"),
    "queued": ("lattice_model_queued_requests", "Requests of this name waiting for the worker"),
    "in_flight": ("lattice_model_in_flight_requests", "Requests of this name sent to the worker and not yet ended"),
}
# A name's state: the worker's, or adapter_error for a name whose adapter
# could not be loaded.
NAME_STATES = (*(s.value for s in State), ADAPTER_ERROR)

# A model split over processes: RankFigures field -> (metric name, help),
# one series per rank, labelled by its rank, host and pid.
RANK_LABELS = ("model", "rank", "host", "pid")
RANK_GAUGES = {
    "rss_bytes": ("lattice_rank_rss_bytes", "Resident set size of one rank of a model split over processes"),
    "uss_bytes": ("lattice_rank_uss_bytes", "Unique set size of one rank of a model split over processes"),
    "mlx_active_bytes": ("lattice_rank_mlx_active_bytes", "MLX active memory in one rank"),
    "weights_bytes": ("lattice_rank_weights_bytes", "Bytes of model weights one rank holds"),
}

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# (model, adapter) label pairs that carry counter and histogram series at
# once; past it, the least recently used pair's series are dropped (its
# counts start again from zero if it comes back). Requests name models and
# adapters, so without a bound a client could grow /metrics for ever.
MAX_LABEL_PAIRS = 256


class LabelPairs:
    """The (model, adapter) label pairs in use, least recently used first,
    each with the series made for it (so that they can be removed)."""

    def __init__(self, cap: int = MAX_LABEL_PAIRS):
        self.cap = cap
        self._series: collections.OrderedDict[tuple[str, str], set[tuple]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def use(self, metric, pair: tuple[str, str], *rest: str):
        """metric.labels(*pair, *rest), counted as a use of `pair`."""
        with self._lock:
            made = self._series.get(pair)
            if made is None:
                made = self._series[pair] = set()
                while len(self._series) > self.cap:
                    _, evicted = self._series.popitem(last=False)
                    for owner, labels in evicted:
                        owner.remove(*labels)
            else:
                self._series.move_to_end(pair)
            made.add((metric, (*pair, *rest)))
            return metric.labels(*pair, *rest)

    def __len__(self) -> int:
        return len(self._series)


class _MeasuredGauges(Collector):
    def __init__(self, snapshot: Callable[[], Status | None], adapter_name: Callable[[str | None], str]):
        self._snapshot = snapshot
        self._adapter_name = adapter_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = self._snapshot()
        if status is None:
            return
        workers = {field: GaugeMetricFamily(name, text, labels=WORKER_LABELS) for field, (name, text) in WORKER_GAUGES.items()}
        names = {field: GaugeMetricFamily(name, text, labels=LABELS) for field, (name, text) in NAME_GAUGES.items()}
        state = GaugeMetricFamily("lattice_model_state", "1 for the name's current state, 0 for the others", labels=(*LABELS, "state"))
        info = GaugeMetricFamily(
            "lattice_model_info",
            "Always 1; format: how the weights are stored; worker and pid: the worker serving this name (the model and pid labels of its lattice_worker_* series)",
            labels=(*LABELS, "format", "worker", "pid"),
        )
        ranks = {field: GaugeMetricFamily(name, text, labels=RANK_LABELS) for field, (name, text) in RANK_GAUGES.items()}
        shown: set[tuple[str, str]] = set()
        for group in by_worker(status.models):
            first = group[0]
            pid = str(first.pid) if first.pid is not None else ""
            for field, family in workers.items():
                family.add_metric([first.model, pid], getattr(first, field))
            for rank in first.ranks or ():
                rank_key = [first.model, str(rank.rank), rank.host, str(rank.pid) if rank.pid is not None else ""]
                for field, family in ranks.items():
                    family.add_metric(rank_key, getattr(rank, field))
            for row in group:
                key = [row.model, self._adapter_name(row.lora)]
                if tuple(key) in shown:
                    # Two adapter files of one name on one model: a page with a
                    # series twice is refused whole, so the first one stands.
                    continue
                shown.add(tuple(key))
                for field, family in names.items():
                    family.add_metric(key, getattr(row, field))
                for value in NAME_STATES:
                    state.add_metric([*key, value], 1.0 if row.state == value else 0.0)
                info.add_metric([*key, row.format or "unknown", first.model, pid], 1.0)
        yield from workers.values()
        yield from names.values()
        yield from (family for family in ranks.values() if family.samples)
        yield state
        yield info
        yield GaugeMetricFamily("lattice_supervisor_rss_bytes", "Resident set size of the supervisor process", value=status.rss_bytes)
        yield GaugeMetricFamily("lattice_system_memory_total_bytes", "Physical memory of the machine", value=status.system_total_bytes)
        yield GaugeMetricFamily("lattice_system_memory_available_bytes", "Memory available to new processes", value=status.system_available_bytes)


class _Process(Collector):
    """The supervisor's own process_* series, as prometheus-client's
    ProcessCollector names them; measured with psutil, because that
    collector reads /proc, which macOS does not have."""

    def __init__(self) -> None:
        self._process = psutil.Process()

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        p = self._process
        try:
            with p.oneshot():
                cpu, memory, started = p.cpu_times(), p.memory_info(), p.create_time()
                fds = p.num_fds()
        except psutil.Error:
            return
        yield CounterMetricFamily("process_cpu_seconds_total", "Total user and system CPU time spent in seconds", value=cpu.user + cpu.system)
        yield GaugeMetricFamily("process_resident_memory_bytes", "Resident memory size in bytes", value=memory.rss)
        yield GaugeMetricFamily("process_virtual_memory_bytes", "Virtual memory size in bytes", value=memory.vms)
        yield GaugeMetricFamily("process_start_time_seconds", "Start time of the process since unix epoch in seconds", value=started)
        yield GaugeMetricFamily("process_open_fds", "Number of open file descriptors", value=fds)
        yield GaugeMetricFamily("process_max_fds", "Maximum number of open file descriptors", value=resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _build_info() -> GaugeMetricFamily:
    try:
        version = importlib.metadata.version("lattice-pool")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    family = GaugeMetricFamily("lattice_build_info", "Always 1; the lattice-pool and Python versions of the supervisor", labels=("version", "python"))
    family.add_metric([version, platform.python_version()], 1.0)
    return family


class _BuildInfo(Collector):
    def __init__(self) -> None:
        self._family = _build_info()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield self._family


def only_metrics(app: Callable) -> Callable:
    """The WSGI app at /metrics (and / , where a browser lands); 404 elsewhere."""

    def serve(environ, start_response):
        if environ.get("PATH_INFO", "") in ("/metrics", "/"):
            return app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: the metrics are at /metrics\n"]

    return serve


class PoolMetrics:
    """The pool's metrics in a registry of their own (several pools, or
    tests, may share a process), and the pool observer that feeds them."""

    def __init__(self, pool: Pool, loop: asyncio.AbstractEventLoop):
        self._pool = pool
        self._loop = loop
        # The *_created series would double the page for little use; the
        # switch is process-wide, and this process is the supervisor.
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("lattice_requests", "Generation requests a worker completed (any finish_reason)", (*LABELS, "surface"), registry=r)
        self.tokens = Counter("lattice_generated_tokens", "Tokens generated", (*LABELS, "surface"), registry=r)
        self.drafted = Counter("lattice_drafted_tokens", "Tokens drafted by speculative decoding (prompt lookup or a draft model)", LABELS, registry=r)
        self.accepted = Counter("lattice_accepted_tokens", "Drafted tokens the model kept (each saves one decode step)", LABELS, registry=r)
        self.errors = Counter(
            "lattice_errors",
            "Error events that end a request or refuse a line, by code; model is empty when no model was resolved",
            (*LABELS, "code", "surface"),
            registry=r,
        )
        self.adapter_reloads = Counter("lattice_adapter_reloads", "Adapter loads after start: outcome loaded or error", (*LABELS, "outcome"), registry=r)
        # Throughput as counters: rate(tokens) / rate(decode seconds) is the
        # decode speed over any window, which a histogram of per-request
        # rates cannot give.
        self.decode_seconds = Counter(
            "lattice_decode_seconds", "Seconds from each request's first token to its end (its decode time)", (*LABELS, "surface"), registry=r
        )
        self.restarts = Counter("lattice_worker_restarts", "Worker restarts after a crash, stall or kill", ("model",), registry=r)
        self.ttft = Histogram("lattice_ttft_seconds", "Time from request start to its first token", (*LABELS, "surface"), buckets=TTFT_BUCKETS, registry=r)
        self.pairs = LabelPairs()
        r.register(_MeasuredGauges(self._snapshot, pool.resolver.adapters.name_of))
        r.register(_Process())
        r.register(_BuildInfo())

    def _labels(self, spec: ModelSpec | None) -> tuple[str, str]:
        """A name's labels: the adapter by its name, never its path (a
        path tells where the pool's files are, and every distinct one would
        be a series)."""
        if spec is None:
            return ("", "")
        return (spec.name, self._pool.resolver.adapters.name_of(spec.lora))

    def _snapshot(self) -> Status | None:
        """Runs on the scrape thread."""
        try:
            future = asyncio.run_coroutine_threadsafe(self._pool.status(), self._loop)
        except RuntimeError:  # the loop has closed: the pool is gone
            return None
        try:
            return future.result(SCRAPE_TIMEOUT)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError) as exc:
            future.cancel()
            log.warning("scrape got no status from the pool (%s); serving counters only", type(exc).__name__)
            return None

    # -- PoolObserver -------------------------------------------------------------

    def request_done(self, spec: ModelSpec, done: Done, surface: str) -> None:
        key = self._labels(spec)
        self.pairs.use(self.requests, key, surface).inc()
        if done.gen_tokens:
            # A request cancelled before its first token has no TTFT or rate.
            self.pairs.use(self.tokens, key, surface).inc(done.gen_tokens)
            self.pairs.use(self.ttft, key, surface).observe(done.ttft_ms / 1000.0)
            self.pairs.use(self.decode_seconds, key, surface).inc(max(0.0, done.total_ms - done.ttft_ms) / 1000.0)
        if done.drafted_tokens:
            self.pairs.use(self.drafted, key).inc(done.drafted_tokens)
            self.pairs.use(self.accepted, key).inc(done.accepted_tokens)

    def error(self, spec: ModelSpec | None, code: str, surface: str) -> None:
        self.pairs.use(self.errors, self._labels(spec), code, surface).inc()

    def adapter_event(self, spec: ModelSpec, loaded: bool) -> None:
        self.pairs.use(self.adapter_reloads, self._labels(spec), "loaded" if loaded else "error").inc()

    def restarted(self, spec: ModelSpec) -> None:
        self.restarts.labels(spec.name).inc()


class _DeadlineReader(io.RawIOBase):
    """A socket's reads under one deadline: a socket timeout alone bounds
    each recv, and a client sending a byte every few seconds kept one of
    the few threads for ever."""

    def __init__(self, sock: socket.socket, deadline: float, timeout: float):
        self._sock = sock
        self._deadline = deadline
        self._timeout = timeout

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive whole in time")
        self._sock.settimeout(left)
        try:
            return self._sock.recv_into(buffer)
        finally:
            self._sock.settimeout(self._timeout)  # writing the answer: per send


class _QuietHandler(WSGIRequestHandler):
    """A request must arrive whole within the server's request_timeout of
    the connection, so an idle or trickling client cannot keep one of the
    few threads."""

    def setup(self) -> None:
        self.timeout = self.server.request_timeout
        super().setup()
        self.rfile.close()  # the socket's own file, whose every recv had its own limit
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + self.timeout, self.timeout))

    def handle(self) -> None:
        try:
            super().handle()
        except TimeoutError:
            log.info("metrics: closing a connection whose request did not arrive whole within %gs (metrics_request_timeout)", self.timeout)

    def log_message(self, format: str, *args: object) -> None:
        pass


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """prometheus-client's server starts a thread per connection without a
    bound; this one serves at most `max_connections` at once and closes
    any connection beyond them at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int, request_timeout: float):
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def get_request(self):
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in RESOURCE_ERRNOS:
                # Out of descriptors the connection stays queued and the socket
                # readable: without a pause, serve_forever would spin on it.
                time.sleep(1.0)
            raise

    def handle_error(self, request, client_address) -> None:
        # socketserver's own prints to sys.stderr; ours goes through the log sink.
        log.exception("metrics: a connection from %s failed", client_address)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            log.warning("metrics: %d connections open (max_metrics_connections); closing another", self.max_connections)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MetricsServer:
    def __init__(self, metrics: PoolMetrics, port: int, max_connections: int = 8, request_timeout: float = 10.0):
        self.metrics = metrics
        server_class = functools.partial(_BoundedServer, max_connections=max_connections, request_timeout=request_timeout)
        try:
            self._server = make_server("127.0.0.1", port, only_metrics(make_wsgi_app(metrics.registry)), server_class, _QuietHandler)
        except OSError as exc:
            raise ConfigError(f"metrics_port {port}: cannot listen on 127.0.0.1: {exc.strerror or exc}") from exc
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()
        self.port = self._server.server_port
        log.info("metrics on http://127.0.0.1:%d/metrics", self.port)

    @classmethod
    def start(cls, pool: Pool, port: int, max_connections: int = 8, request_timeout: float = 10.0) -> MetricsServer:
        metrics = PoolMetrics(pool, asyncio.get_running_loop())
        pool.observers.append(metrics)
        return cls(metrics, port, max_connections, request_timeout)

    async def close(self) -> None:
        # shutdown() waits for the serve loop's next poll: not on the event loop.
        await asyncio.to_thread(self._server.shutdown)
        self._server.server_close()
        self._thread.join(timeout=5)
