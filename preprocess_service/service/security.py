"""What keeps a bad or greedy client from taking the service down: TLS / mutual TLS, bearer-token
authentication, per-client stream limits, and shard-URL prefixes.

- TLS: ``server_credentials`` loads a certificate and key; with a client CA every client must
  present a certificate that CA signed (mutual TLS).
- Tokens: ``TokenAuth`` (a server interceptor) lets a call through only with metadata
  ``authorization: Bearer <token>`` naming one of the configured tokens (compared in constant
  time), else UNAUTHENTICATED. The gRPC health service stays open: load balancers and
  Kubernetes probes send no credentials.
- ``StreamLimiter``: at most N concurrent streams per client (its token, else its address),
  else RESOURCE_EXHAUSTED.
- shard sources (schemes, prefixes, bounded expansion) are sources.py's.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from disttrain_api.errors import DisttrainError, ResourceExhausted

HEALTH_PREFIX = "/grpc.health.v1.Health/"
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: Path
    """PEM certificate chain the server presents."""
    key: Path
    """PEM private key of ``cert``."""
    client_ca: Path | None = None
    """PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS)."""


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise DisttrainError(f"cannot read the TLS {what} {path}: {exc.strerror}") from None


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    client_ca = _read(tls.client_ca, "client CA") if tls.client_ca else None
    return grpc.ssl_server_credentials([(_read(tls.key, "key"), _read(tls.cert, "certificate"))],
                                       root_certificates=client_ca, require_client_auth=client_ca is not None)


def client_identity(context, *, authenticated: bool) -> str:
    """Who a call comes from: with token auth on, its token (the interceptor let only a valid one
    through); otherwise its address without the port, whatever headers it sends (a header nobody
    checked proves nothing, so it never picks whose limits apply)."""
    if authenticated:
        for key, value in context.invocation_metadata():
            if key == "authorization":
                # a digest names it in logs and limits without revealing any of the secret
                return "token:" + hashlib.sha256(value.encode()).hexdigest()[:12]
    peer = context.peer()  # "ipv4:127.0.0.1:5555", "ipv6:[::1]:5555", "unix:..."
    return peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer


class TokenAuth(grpc.ServerInterceptor):
    def __init__(self, tokens: Sequence[str]):
        if not tokens or any(not t for t in tokens):
            raise ValueError("token authentication needs at least one non-empty token")
        self._expected = [f"Bearer {t}".encode() for t in tokens]

    def _allowed(self, metadata) -> bool:
        sent = next((v for k, v in metadata or () if k == "authorization"), None)
        if sent is None:
            return False
        sent = sent.encode() if isinstance(sent, str) else sent
        return any(hmac.compare_digest(sent, expected) for expected in self._expected)

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX) or self._allowed(details.invocation_metadata):
            return handler
        message = ("missing or unknown bearer token: send metadata 'authorization: Bearer <token>' "
                   "(DataClient(token=...) or DISTTRAIN_AUTH_TOKEN)")

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        kind = ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream
                else "stream_unary" if handler.stream_unary else "stream_stream")
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


class StreamLimiter:
    """Counts open streams per client; ``acquire`` raises ResourceExhausted past the limit (0: none)."""

    def __init__(self, max_per_client: int):
        self.max_per_client = max_per_client
        self._lock = threading.Lock()
        self._open: dict[str, int] = defaultdict(int)

    def acquire(self, client: str) -> None:
        with self._lock:
            if self.max_per_client and self._open[client] >= self.max_per_client:
                raise ResourceExhausted(f"client {client} already has {self._open[client]} open streams, the "
                                        f"most this service allows one client (max_streams_per_client)")
            self._open[client] += 1

    def release(self, client: str) -> None:
        with self._lock:
            self._open[client] -= 1
            if self._open[client] <= 0:
                del self._open[client]


class StallWatchdog:
    """Cancels a stream whose client has not taken a message for ``timeout_s`` (a peer that is
    alive but does not read holds a handler thread and its prepared microbatches; keepalive
    pings cannot see it, since its transport still answers them). One thread for every stream."""

    def __init__(self, timeout_s: float, interval_s: float = 1.0):
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sending: dict[int, tuple[float, object, str]] = {}
        self._stopped = threading.Event()
        self.num_cancelled = 0
        threading.Thread(target=self._run, args=(interval_s,), name="stall-watchdog", daemon=True).start()

    def sending(self, token: int, context, what: str) -> None:
        """A message of ``context``'s stream is being handed to gRPC now."""
        with self._lock:
            self._sending[token] = (time.monotonic(), context, what)

    def sent(self, token: int) -> None:
        with self._lock:
            self._sending.pop(token, None)

    def _run(self, interval_s: float) -> None:
        while not self._stopped.wait(min(interval_s, self.timeout_s / 2)):
            now = time.monotonic()
            with self._lock:
                stalled = [(token, ctx, what) for token, (since, ctx, what) in self._sending.items()
                           if now - since > self.timeout_s]
                for token, *_ in stalled:
                    del self._sending[token]
            for _, context, what in stalled:
                log.warning("%s: the client took no message for %g s; the stream is cancelled "
                            "(stream_stall_timeout_s)", what, self.timeout_s)
                self.num_cancelled += 1
                context.cancel()

    def close(self) -> None:
        self._stopped.set()
