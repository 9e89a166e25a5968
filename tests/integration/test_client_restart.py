"""A client whose only service node restarts mid-run: its calls (an acknowledgement) wait for the
node to come back within the client's reconnect limit, as its stream does, not just its connect
timeout (found by bench/faults.py's state-disk-full fault, where a loaded node took over 10 s to
restart and a rank's acknowledgement crashed it)."""

from __future__ import annotations

import socket
import threading
import time

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
