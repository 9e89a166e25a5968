"""The service's front door, up before the rest: ``serve`` binds its port and answers health a
fraction of a second after launch, while the planner, the decode workers and the jobs' machinery
are imported and started behind it (which takes seconds). Light on purpose: gRPC, its health and
reflection services and the security module only.

Health (grpc.health.v1), as a container orchestrator or ``disttrain health`` reads it:

- "" and the Preprocess service: NOT_SERVING while the service starts, SERVING once its calls
  are attached (``attach``); a Preprocess call before that fails UNAVAILABLE ("starting"), which
  clients retry like any unavailable server;
- WARM_SERVICE: NOT_SERVING until the planner's compiled kernels are loaded and the decode workers
  are up (``warm``), SERVING after. The service serves meanwhile (a job's first step waits for
  what it needs): ``disttrain health`` prints SERVING (warming).
"""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from disttrain_api.channel import MAX_MESSAGE_BYTES, SERVICE_NAME
from disttrain_api.errors import ConfigError
from preprocess_service.service.security import TlsFiles, TokenAuth, server_credentials

WARM_SERVICE = f"{SERVICE_NAME}/warm"
"""The health entry that says whether the service is warm (planner kernels loaded, decode workers up)."""

SERVER_KEEPALIVE_OPTIONS = [
    # the server pings its clients too: a vanished peer's connection (and its stream) is closed
    ("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000), ("grpc.http2.ping_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
    # clients may ping every second (tests, fast failover); more often is abuse
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    # a connection with no call for 5 minutes is closed; a handshake must finish in 10 s
    ("grpc.max_connection_idle_ms", 300_000), ("grpc.server_handshake_timeout_ms", 10_000),
]


def _starting(request, context):
    context.abort(grpc.StatusCode.UNAVAILABLE, "the service is starting; try again in a moment")


_STARTING = {
    "unary": grpc.unary_unary_rpc_method_handler(_starting),
    "stream": grpc.unary_stream_rpc_method_handler(_starting),
}


class _Attached(grpc.GenericRpcHandler):
    """The Preprocess service's calls: UNAVAILABLE until ``handlers`` are set, then theirs."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] | None = None
        self._prefix = f"/{SERVICE_NAME}/"

    def service(self, handler_call_details):
        method = handler_call_details.method
        if not method.startswith(self._prefix):
            return None
        handlers = self.handlers
        if handlers is None:
            return _STARTING["stream" if method.endswith("/StreamMicrobatches") else "unary"]
        return handlers.get(method[len(self._prefix):])


class Front:
    """A started gRPC server bound to ``address`` that answers health and reflection at once and
    the Preprocess service once ``attach`` gives its handlers."""

    def __init__(self, address: str, *, max_workers: int, max_request_bytes: int, tokens: tuple[str, ...] = (),
                 tls: TlsFiles | None = None):
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", max_request_bytes), *SERVER_KEEPALIVE_OPTIONS]
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options,
                                  interceptors=[TokenAuth(tokens)] if tokens else [])
        self._attached = _Attached()
        self.server.add_generic_rpc_handlers((self._attached,))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        for name in ("", SERVICE_NAME, WARM_SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        self.port = self.server.add_secure_port(address, server_credentials(tls)) if tls \
            else self.server.add_insecure_port(address)
        if self.port == 0:
            raise ConfigError(f"cannot bind the service to {address!r}")
        self.server.start()

    def attach(self, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        """The Preprocess service's method handlers, by method name: served from now on."""
        self._attached.handlers = dict(handlers)
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    def warm(self) -> None:
        """The planner's kernels are loaded and the decode workers up."""
        self.health.set(WARM_SERVICE, health_pb2.HealthCheckResponse.SERVING)
