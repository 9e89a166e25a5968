"""A client whose only service node restarts mid-run: its calls (an acknowledgement) wait for the
node to come back within the client's reconnect limit, as its stream does, not just its connect
timeout (found by bench/faults.py's state-disk-full fault, where a loaded node took over 10 s to
restart and a rank's acknowledgement crashed it)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc

from disttrain_api.config import JobConfig
from helpers import write_tiny_shards
from preprocess_service.service.server import create_server
from trainer import DataClient


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_acknowledgement_waits_for_a_restarting_node_within_the_reconnect_limit(tmp_path):
    write_tiny_shards(tmp_path / "shards", num_shards=1, samples_per_shard=24)
    config = JobConfig(shards=(str(tmp_path / "shards"),), dp_size=1, seq_len=1024, num_microbatches=2)
    port = _free_port()
    server, _, _ = create_server(f"127.0.0.1:{port}", decode_workers=0)
    restarted = []
    try:
        with DataClient(f"127.0.0.1:{port}", config, 0, prefetch=1, connect_timeout_s=1.0,
                        reconnect_timeout_s=60.0) as client:
            next(client)
            server.stop(0).wait()
            down_at = time.monotonic()

            def restart():  # the node is back after three connect timeouts
                time.sleep(3.0)
                restarted.append(create_server(f"127.0.0.1:{port}", decode_workers=0)[0])

            thread = threading.Thread(target=restart)
            thread.start()
            try:
                client.acknowledge(1)  # the restarted node does not know the job: opened again
            finally:
                thread.join()
            assert time.monotonic() - down_at >= 3.0, "the call was answered by a node that was down"
    finally:
        for node in restarted:
            node.stop(0).wait()


class _Starting(grpc.GenericRpcHandler):
    """A port that is bound but answers every call UNAVAILABLE (a node still starting behind it)."""

    def __init__(self):
        self.calls = 0
        """Unary calls refused (the client's stream, retrying on its own, is counted apart)."""
        self.streams = 0

    def service(self, handler_call_details):
        stream = handler_call_details.method.endswith("/StreamMicrobatches")

        def refuse(request, context):
            if stream:
                self.streams += 1
            else:
                self.calls += 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "starting")
        return grpc.unary_unary_rpc_method_handler(refuse)


def test_a_call_waits_while_a_bound_port_answers_unavailable_starting(tmp_path):
    """A restarting node whose port answers UNAVAILABLE at once (a front door up before the service,
    a proxy before its backend) is waited for as a refused connection is: the tries do not run out
    in milliseconds, and back off rather than hammer the port."""
    write_tiny_shards(tmp_path / "shards", num_shards=1, samples_per_shard=24)
    config = JobConfig(shards=(str(tmp_path / "shards"),), dp_size=1, seq_len=1024, num_microbatches=2)
    port = _free_port()
    server, _, _ = create_server(f"127.0.0.1:{port}", decode_workers=0)
    nodes = []
    try:
        with DataClient(f"127.0.0.1:{port}", config, 0, prefetch=1, connect_timeout_s=1.0,
                        reconnect_timeout_s=60.0) as client:
            next(client)
            server.stop(0).wait()
            starting = _Starting()
            front = grpc.server(futures.ThreadPoolExecutor(2), handlers=[starting])
            front.add_insecure_port(f"127.0.0.1:{port}")
            front.start()
            nodes.append(front)
            down_at = time.monotonic()

            def restart():  # the service comes up behind the port 3 s later
                time.sleep(3.0)
                front.stop(0).wait()
                nodes.append(create_server(f"127.0.0.1:{port}", decode_workers=0)[0])

            thread = threading.Thread(target=restart)
            thread.start()
            try:
                client.acknowledge(1)
            finally:
                thread.join()
            assert time.monotonic() - down_at >= 3.0, "the call was answered while the port said starting"
            assert 2 <= starting.calls <= 8, f"{starting.calls} calls in 3 s: no backoff between them"
    finally:
        for node in nodes:
            node.stop(0).wait()


def test_a_stream_waits_while_a_bound_port_answers_unavailable_starting(tmp_path):
    """The stream, like a call: its node restarts behind a port that refuses it at once; it resumes
    where it was once the service is back."""
    write_tiny_shards(tmp_path / "shards", num_shards=2, samples_per_shard=48)
    config = JobConfig(shards=(str(tmp_path / "shards"),), dp_size=1, seq_len=512, num_microbatches=2)
    port = _free_port()
    server, _, _ = create_server(f"127.0.0.1:{port}", decode_workers=0)
    nodes = []
    try:
        with DataClient(f"127.0.0.1:{port}", config, 0, prefetch=1, connect_timeout_s=1.0,
                        reconnect_timeout_s=60.0, shared_memory=False) as client:
            first = next(client)
            server.stop(0).wait()
            starting = _Starting()
            front = grpc.server(futures.ThreadPoolExecutor(2), handlers=[starting])
            front.add_insecure_port(f"127.0.0.1:{port}")
            front.start()
            nodes.append(front)
            time.sleep(3.0)
            front.stop(0).wait()
            nodes.append(create_server(f"127.0.0.1:{port}", decode_workers=0)[0])
            seen = [(first.step, first.microbatch_index)] + [(mb.step, mb.microbatch_index) for mb in client]
            # each microbatch once, in order: every step whole (2 microbatches; the last may hold fewer)
            expected = [(step, index) for step in range(seen[-1][0] + 1) for index in range(2)][:len(seen)]
            assert seen == expected and len(seen) >= 4, seen
            assert client.num_reconnects >= 1
            assert starting.streams >= 1
    finally:
        for node in nodes:
            node.stop(0).wait()
