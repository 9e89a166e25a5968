"""How clients and servers talk: the service's name, message size limits and keepalive."""

from __future__ import annotations

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


def channel_credentials(ca: Path | None = None, cert: Path | None = None, key: Path | None = None):
    """Client side: trust ``ca`` (default: the system roots); present ``cert``/``key`` for mutual TLS."""
    return grpc.ssl_channel_credentials(root_certificates=_read(ca, "CA") if ca else None,
                                        private_key=_read(key, "client key") if key else None,
                                        certificate_chain=_read(cert, "client certificate") if cert else None)


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise DisttrainError(f"cannot read the TLS {what} {path}: {exc.strerror}") from None
