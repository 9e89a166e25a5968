"""Prometheus metrics of a service process (``serve --metrics-port``, default 9400, path /metrics).

The endpoint (``serve``) binds to loopback (127.0.0.1) unless the caller passes another host: a
deployment whose Prometheus scrapes from another pod sets ``metrics_host = "0.0.0.0"`` (or the
pod's address) on purpose. Given bearer tokens, every request must carry
``Authorization: Bearer <one of them>`` (compared in constant time); any other request gets 401
with ``WWW-Authenticate: Bearer`` and no metric in the body, so Prometheus needs
``authorization: {credentials_file: ...}`` in its scrape config. Without tokens anyone who can
reach the address reads the metrics. Only GET ``/metrics`` (and ``/``) serve them, other paths are
404. Each connection must send its request within ``timeout_s`` (10 s) in total and is then closed,
and at most ``max_connections`` are served at once, so idle or trickling clients cannot pile up
threads.

Counters and gauges live in prometheus_client's process-wide registry, which is the usual
layout for one server per process; the server and the Redis store update them where the events
happen. Names, with the PromQL a dashboard would use:

- ``disttrain_items_sent_total{modality}``: samples, images, audio clips and images to
  generate sent to trainers (``rate(...[1m])`` = samples/s per modality);
- ``disttrain_microbatches_sent_total``, ``disttrain_sent_bytes_total``;
- ``disttrain_decode_errors_total{reason,stage}``: samples skipped, by reason, when planning
  (metadata, text, headers) or decoding (pixels, audio);
- ``disttrain_queue_depth{queue}``: microbatches in decode (``decode``) and prepared, waiting for
  gRPC (``send``), over all streams;
- ``disttrain_active_streams``;
- ``disttrain_step_dp_imbalance{job}``: max/mean planned rank load of the last step sent;
- ``disttrain_step_bubble_fraction{job,source}``: the simulator's predicted idle share of the
  last step sent (``predicted``) and the one the trainer measured and reported (``measured``);
- ``disttrain_stream_lag_steps{job,rank}``: steps a rank's stream is behind the job's furthest rank;
- ``disttrain_redis_round_trip_seconds``: histogram of Redis round trips (pipelines, scripts);
- ``disttrain_shard_fetched_bytes_total{scheme}``: bytes of remote shards received (http, https,
  s3, gs), per scheme rather than per URL (100,000 shards would be 100,000 series;
  ``ShardCache.stats()`` has them per URL);
- ``disttrain_shard_cache_events_total{event}``: the remote-shard cache's hits, misses, shards
  streamed uncached (bypass), evictions, retries, resumed and restarted downloads, failed shards
  (io/cache.py);
- ``disttrain_shard_cache_bytes``: bytes the cache holds or has reserved for downloads.
"""

from __future__ import annotations

import hmac
import io
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest

from disttrain_api.errors import ConfigError

log = logging.getLogger(__name__)

ITEMS_SENT = Counter("disttrain_items_sent", "Items sent to trainers, by modality "
                     "(sample, image, audio, generation, video)", ["modality"])
MICROBATCHES_SENT = Counter("disttrain_microbatches_sent", "Microbatches sent to trainers")
BYTES_SENT = Counter("disttrain_sent_bytes", "Microbatch payload bytes sent to trainers")
DECODE_ERRORS = Counter("disttrain_decode_errors", "Samples skipped, by reason (errors.SampleError.KINDS) and "
                        "stage: plan (parsing metadata, text, image headers) or decode (pixels, audio)",
                        ["reason", "stage"])
QUEUE_DEPTH = Gauge("disttrain_queue_depth", "Microbatches in a queue, over all streams", ["queue"])
ACTIVE_STREAMS = Gauge("disttrain_active_streams", "Open microbatch streams")
HELD_PLANS = Gauge("disttrain_job_held_plans", "Step plans a single-node job holds: from its lowest acknowledged "
                   "step to its planning frontier (acknowledging frees them)", ["job"])
ACKED_STEP = Gauge("disttrain_job_acknowledged_step", "The step every rank of a job acknowledged (checkpointed): "
                   "no rank resumes before it", ["job"])
DP_IMBALANCE = Gauge("disttrain_step_dp_imbalance", "Max/mean planned rank load of the last step sent", ["job"])
BUBBLE = Gauge("disttrain_step_bubble_fraction", "Idle share of the pipeline in the last step: the simulator's "
               "prediction or the trainer's measurement", ["job", "source"])
STREAM_LAG = Gauge("disttrain_stream_lag_steps", "Steps a rank's stream is behind the job's furthest rank",
                   ["job", "rank"])
STATE_SAVE_ERRORS = Counter("disttrain_state_save_errors", "Saves of a job's state to state_dir that failed (a "
                            "full or read-only disk); the job goes on from memory", ["job"])
REDIS_LOST_WRITES = Counter("disttrain_redis_lost_writes", "Times a replica found Redis holding fewer committed "
                            "steps of a job than it had seen (a failover or a restart without AOF lost "
                            "acknowledged writes)", ["job"])
REDIS_LATENCY = Histogram("disttrain_redis_round_trip_seconds", "Redis round trips (one pipeline or script)",
                          buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
SHARD_FETCHED_BYTES = Counter("disttrain_shard_fetched_bytes", "Bytes of remote shards received over the "
                              "network, by scheme", ["scheme"])
SHARD_CACHE_EVENTS = Counter("disttrain_shard_cache_events", "Remote-shard cache events: hit, miss, bypass (streamed "
                             "uncached), eviction, retry, resume, restart, failure", ["event"])
PLUGIN_CPU = Counter("disttrain_plugin_cpu_seconds", "CPU seconds inside operator plugins' hooks, by job, plugin "
                     "and hook (sample: once per planned sample; media: once per decoded item)",
                     ["job", "plugin", "hook"])
PLUGIN_CALLS = Counter("disttrain_plugin_calls", "Calls of operator plugins' hooks, by job, plugin and hook "
                       "(rate(disttrain_plugin_cpu_seconds_total) / rate(disttrain_plugin_calls_total): CPU per "
                       "sample or item)", ["job", "plugin", "hook"])
SHARD_CACHE_BYTES = Gauge("disttrain_shard_cache_bytes", "Bytes of remote shards cached on disk or reserved for "
                          "downloads under way")

for _modality in ("sample", "image", "audio", "generation", "video"):
    ITEMS_SENT.labels(_modality)
for _queue in ("decode", "send"):
    QUEUE_DEPTH.labels(_queue)
for _event in ("hit", "miss", "bypass", "eviction", "retry", "resume", "restart", "failure"):
    SHARD_CACHE_EVENTS.labels(_event)


def serve(port: int, host: str = "127.0.0.1", tokens: Sequence[str] = (), *, timeout_s: float = 10.0,
          max_connections: int = 64) -> tuple[ThreadingHTTPServer, threading.Thread, int]:
    """Starts the /metrics HTTP endpoint in a daemon thread; returns (server, thread, bound port).

    ``host`` defaults to loopback; pass ``"0.0.0.0"`` (or ``"::"``) to be scraped from elsewhere.
    ``tokens``: bearer tokens a scrape may present; empty: no token needed. ``port`` 0 binds any
    free port (the returned one). ``timeout_s`` bounds the time a connection may take to send its
    request (in total) and to take the response; beyond ``max_connections`` open connections, new
    ones are closed at once. ``server.shutdown(); server.server_close()`` stops it.
    """
    if not 0 <= port < 65536:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: not a port number (set metrics_port, 0 = off)")
    if isinstance(tokens, (str, bytes)):
        raise TypeError("tokens is a sequence of tokens, not one string")  # else each character would be one
    if any(not t for t in tokens):
        raise ConfigError("metrics tokens must not be empty strings")
    if timeout_s <= 0 or max_connections < 1:
        raise ConfigError(f"metrics timeout_s ({timeout_s}) must be > 0 and max_connections ({max_connections}) >= 1")
    handler = type("_Handler", (_MetricsHandler,), {
        "timeout": timeout_s, "tokens": tuple(t.encode() for t in tokens)})
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server = _MetricsServer((host, port), handler, family, max_connections)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc} "
                          "(set metrics_port, 0 = off)") from None
    thread = threading.Thread(target=server.serve_forever, name=f"metrics-http-{server.server_port}", daemon=True)
    thread.start()
    return server, thread, server.server_port


class _MetricsServer(ThreadingHTTPServer):
    """One daemon thread per connection, at most ``max_connections`` at once."""

    daemon_threads = True
    block_on_close = False  # server_close() does not wait for connections still open (each is bounded anyway)

    def __init__(self, address, handler, family: int, max_connections: int):
        self.address_family = family
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._last_refusal_logged = float("-inf")
        super().__init__(address, handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN (reverse DNS, which can hang); not needed here.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            if time.monotonic() - self._last_refusal_logged > 60:  # at most one line a minute, whatever the flood
                self._last_refusal_logged = time.monotonic()
                log.warning("metrics endpoint: %d connections open, closing new ones (one from %s)",
                            self.max_connections, client_address[0])
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _DeadlineReader(io.RawIOBase):
    """Reads a socket until a deadline for the whole request, not per recv: a client trickling a
    byte every few seconds is cut off like one that sends nothing."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not received in time")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _MetricsHandler(BaseHTTPRequestHandler):
    timeout: float = 10.0  # StreamRequestHandler.setup sets it on the socket
    tokens: tuple[bytes, ...] = ()
    server_version = "disttrain-metrics"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + self.timeout))

    def do_GET(self) -> None:
        self.connection.settimeout(self.timeout)  # the response gets its own timeout_s (sendall: in total)
        if not self._authorized():
            self._reply(401, b"unauthorized: send Authorization: Bearer <token>\n", "text/plain; charset=utf-8",
                        {"WWW-Authenticate": "Bearer"})
        elif urlsplit(self.path).path not in ("/metrics", "/"):
            self._reply(404, b"not found: metrics are at /metrics\n", "text/plain; charset=utf-8")
        else:
            self._reply(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)

    def _authorized(self) -> bool:
        if not self.tokens:
            return True
        values = self.headers.get_all("Authorization") or []
        if len(values) != 1:
            return False
        scheme, _, credential = values[0].strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = credential.strip().encode("latin-1", "replace")  # http.client decoded the header as latin-1
        ok = False
        for token in self.tokens:  # all of them, whatever matches: the time does not tell which
            ok |= hmac.compare_digest(given, token)
        return ok

    def _reply(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # `format`: BaseHTTPRequestHandler's name
        log.debug("metrics endpoint %s: " + format, self.address_string(), *args)


def microbatch_sent(arrays, nbytes: int) -> None:
    """Counts one microbatch message (assemble.MicrobatchArrays) as it is handed to gRPC."""
    MICROBATCHES_SENT.inc()
    BYTES_SENT.inc(nbytes)
    ITEMS_SENT.labels("sample").inc(len(arrays.sample_keys))
    for modality, name in (("image", "image_spans"), ("audio", "audio_spans"), ("generation", "gen_spans"),
                           ("video", "video_spans")):
        if name in arrays.arrays:
            ITEMS_SENT.labels(modality).inc(len(arrays.arrays[name]))


def step_planned(job_id: str, plan) -> None:
    """Sets the step gauges from a StepPlan as its first microbatch goes out."""
    DP_IMBALANCE.labels(job_id).set(plan.imbalance()[0])
    if "bubble_fraction" in plan.simulation:
        BUBBLE.labels(job_id, "predicted").set(plan.simulation["bubble_fraction"])


def plugin_spent(job_id: str, plugin: str, hook: str, cpu_s: float, calls: int) -> None:
    PLUGIN_CPU.labels(job_id, plugin, hook).inc(max(0.0, cpu_s))
    PLUGIN_CALLS.labels(job_id, plugin, hook).inc(calls)


def bubble_measured(job_id: str, fraction: float) -> None:
    BUBBLE.labels(job_id, "measured").set(fraction)


class StreamLag:
    """Per job, the last step sent to each rank; the lag gauge is the furthest rank's minus this one's."""

    def __init__(self):
        self._sent: dict[str, dict[int, int]] = {}

    def step_sent(self, job_id: str, rank: int, step: int) -> None:
        sent = self._sent.setdefault(job_id, {})
        sent[rank] = max(step, sent.get(rank, -1))
        front = max(sent.values())
        for r, s in sent.items():
            STREAM_LAG.labels(job_id, str(r)).set(front - s)


MEMORY_BUDGET = Gauge("disttrain_memory_budget_bytes", "The server's memory budget: its size (total), the idle "
                      "service's resident memory (baseline), what is charged now (used) and the most ever "
                      "charged (peak), the last sample of the service's resident memory (resident) and its "
                      "highest (resident_peak)", ["kind"])


def watch_budget(budget) -> None:
    """Exports a budget.MemoryBudget: read at every scrape, so nothing needs updating."""
    MEMORY_BUDGET.labels("total").set_function(lambda: budget.total)
    MEMORY_BUDGET.labels("used").set_function(lambda: budget.used)
    MEMORY_BUDGET.labels("peak").set_function(lambda: budget.peak)
    MEMORY_BUDGET.labels("baseline").set_function(lambda: budget.baseline)
    MEMORY_BUDGET.labels("resident").set_function(lambda: budget.resident)
    MEMORY_BUDGET.labels("resident_peak").set_function(lambda: budget.resident_peak)
