"""How clients and servers talk: the service's name, message size limits and keepalive."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from disttrain_api import preprocess_pb2 as pb
from disttrain_api.errors import DisttrainError

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Preprocess"].full_name
MAX_MESSAGE_BYTES = 1 << 30
"""Both directions; a microbatch of 8 x 8192 tokens of 1024-token images is ~150 MiB."""
KEEPALIVE_S = 15.0
"""Clients ping an idle connection this often; a server that does not answer within
KEEPALIVE_TIMEOUT_S (stopped, partitioned, its host gone) fails the call, and the client moves on."""
KEEPALIVE_TIMEOUT_S = 5.0


def channel_options(keepalive_s: float = KEEPALIVE_S, keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S) -> list:
    """Client channel options: large messages both ways, and keepalive pings even while no data flows."""
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # without this a client waits 5 minutes between pings once data stops: a stopped server
            # would go unnoticed that long
            ("grpc.http2.min_ping_interval_without_data_ms", int(keepalive_s * 1000)),
            # and gRPC core gives any ping 60 s unless told otherwise
            ("grpc.http2.ping_timeout_ms", int(keepalive_timeout_s * 1000))]


CHANNEL_OPTIONS = channel_options()


def channel_credentials(ca: Path | str | None = None, cert: Path | str | None = None,
                        key: Path | str | None = None):
    """Client side: trust ``ca`` (default: the system roots); present ``cert``/``key`` for mutual TLS."""
    return grpc.ssl_channel_credentials(root_certificates=_read(ca, "CA") if ca else None,
                                        private_key=_read(key, "client key") if key else None,
                                        certificate_chain=_read(cert, "client certificate") if cert else None)


def _read(path: Path | str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise DisttrainError(f"cannot read the TLS {what} {path}: {exc.strerror}") from None


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call."""

    def __init__(self, token: str):
        self._metadata = (("authorization", f"Bearer {token}"),)

    def _details(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self._metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


@dataclass(frozen=True, slots=True)
class Credentials:
    """How a client proves itself and checks the server. Each field defaults to its environment
    variable, the names the service's deployment files use."""

    token: str | None = None
    """Bearer token (DISTTRAIN_AUTH_TOKEN)."""
    tls_ca: str | None = None
    """PEM CA that signed the server's certificate; setting it (or tls=True) turns TLS on (DISTTRAIN_TLS_CA)."""
    tls_cert: str | None = None
    """PEM client certificate, for mutual TLS (DISTTRAIN_TLS_CERT)."""
    tls_key: str | None = None
    """PEM key of tls_cert (DISTTRAIN_TLS_KEY)."""
    tls: bool = False
    """TLS with the system's trusted roots."""

    @classmethod
    def from_env(cls) -> Credentials:
        env = os.environ.get
        return cls(token=env("DISTTRAIN_AUTH_TOKEN") or None, tls_ca=env("DISTTRAIN_TLS_CA") or None,
                   tls_cert=env("DISTTRAIN_TLS_CERT") or None, tls_key=env("DISTTRAIN_TLS_KEY") or None)

    def channel(self, address: str, options: list | None = None):
        options = channel_options() if options is None else options
        if self.tls or self.tls_ca or self.tls_cert:
            creds = channel_credentials(self.tls_ca, self.tls_cert, self.tls_key)
            channel = grpc.secure_channel(address, creds, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        return grpc.intercept_channel(channel, _BearerToken(self.token)) if self.token else channel
