"""Same-host delivery in shared memory (adapters/shmdelivery.py, trainer/client.py): a real server
on loopback, real DataClients and raw gRPC calls; the objects are real files in /dev/shm."""

from __future__ import annotations

import os
import secrets
import threading
import time

import grpc
import numpy as np
import pytest

from disttrain_api import preprocess_pb2 as pb
from disttrain_api import preprocess_pb2_grpc as pb_grpc
from disttrain_api import wire
from disttrain_api.channel import CHANNEL_OPTIONS
from disttrain_api.config import JobConfig
from disttrain_api.spec import spec_from_config
from helpers import write_tiny_shards
from preprocess_service.adapters.shmdelivery import SHM_DIR
from preprocess_service.service.server import Limits, create_server
from trainer import DataClient

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this platform")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    write_tiny_shards(root, num_shards=2, samples_per_shard=30)
    return root


def _serve(**limits):
    server, port, servicer = create_server("127.0.0.1:0", limits=Limits(**limits))
    return server, f"127.0.0.1:{port}", servicer


def _ours() -> set[str]:
    """This process's microbatch objects (the servers here are in-process) and every probe."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith((f"dtmb_{os.getpid():08x}_", "dtprobe_"))}


def _consume(address, config, shared_memory):
    with DataClient(address, config, 0, prefetch=2, shared_memory=shared_memory) as client:
        mbs = list(client)
        return mbs, client.num_shared_memory


def test_same_host_clients_get_the_same_tensors_in_shared_memory_and_nothing_is_left(shards):
    before = _ours()
    config = JobConfig(shards=(str(shards),), seq_len=2048, dp_size=1, num_microbatches=2, seed=4)
    results = []
    for shared_memory in (True, False):  # a server each: the same job planned twice, the same way
        server, address, _ = _serve()
        try:
            results.append(_consume(address, config, shared_memory))
        finally:
            server.stop(grace=0).wait()
    (by_shm, shm_count), (by_grpc, grpc_count) = results
    assert shm_count == len(by_shm) > 3 and grpc_count == 0
    assert len(by_shm) == len(by_grpc)
    for a, b in zip(by_shm, by_grpc):
        assert a.sample_keys == b.sample_keys
        for name in ("tokens", "position_ids", "modality", "loss_mask", "labels", "cu_seqlens", "gen_images"):
            assert np.array_equal(getattr(a, name).numpy(), getattr(b, name).numpy()), name
        assert all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a.images, b.images))
    by_shm[0].tokens[0, 0] = 7  # the tensors own writable memory (a private mapping)
    assert _ours() == before, "shared-memory objects or probes left in /dev/shm"


def test_an_operator_can_turn_it_off(shards):
    server, address, _ = _serve(shm_delivery=False)
    try:
        config = JobConfig(shards=(str(shards),), seq_len=2048, dp_size=1, num_microbatches=2)
        mbs, count = _consume(address, config, True)
    finally:
        server.stop(grace=0).wait()
    assert mbs and count == 0


def _raw_stream(channel, shards, seq_len: int, probe: str, token: bytes):
    """A job of ``shards`` opened and rank 0 streamed by a bare gRPC call offering ``probe``."""
    stub = pb_grpc.PreprocessStub(channel)
    config = JobConfig(shards=(str(shards),), seq_len=seq_len, dp_size=1, num_microbatches=2)
    info = stub.OpenJob(pb.OpenJobRequest(spec=spec_from_config(config)), timeout=60)
    return stub.StreamMicrobatches(pb.StreamRequest(job_id=info.job_id, dp_rank=0, shm_probe=probe,
                                                    shm_probe_token=token), timeout=60)


def _probe(content: bytes, name: str | None = None) -> str:
    name = name or f"dtprobe_{secrets.token_hex(16)}"
    with open(os.path.join(SHM_DIR, name), "wb") as f:
        f.write(content)
    return name


@pytest.mark.parametrize("case", ["wrong token", "traversal", "symlink", "short token", "fifo"])
def test_a_probe_the_server_cannot_verify_gets_the_bytes_in_the_message(shards, case):
    token = secrets.token_bytes(32)
    made = []
    if case == "wrong token":
        name = _probe(secrets.token_bytes(32))
    elif case == "traversal":
        name = "../../etc/passwd"
    elif case == "symlink":  # a link to a file holding the token: never followed
        target = _probe(token)
        name = f"dtprobe_{secrets.token_hex(16)}"
        os.symlink(os.path.join(SHM_DIR, target), os.path.join(SHM_DIR, name))
        made.append(target)
    elif case == "short token":
        token = b"abc"
        name = _probe(token)
    else:  # a FIFO would block a reader without O_NONBLOCK
        name = f"dtprobe_{secrets.token_hex(16)}"
        os.mkfifo(os.path.join(SHM_DIR, name))
    made.append(name)
    server, address, _ = _serve()
    try:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            call = _raw_stream(channel, shards, 2048, name, token)
            first = next(call)
            call.cancel()
    finally:
        server.stop(grace=0).wait()
        for n in made:
            if "/" not in n:
                os.unlink(os.path.join(SHM_DIR, n))
    assert not first.shm_name and first.tensors


def test_a_client_that_takes_nothing_holds_at_most_the_window_and_its_objects_go_with_the_stream(shards):
    """A raw call with a valid probe that never opens its objects: the server stops at its window
    (prefetch + 2) instead of running ahead, and unlinks them all when the call ends."""
    token = secrets.token_bytes(32)
    probe = _probe(token)
    server, address, servicer = _serve()
    names: list[str] = []
    try:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            call = _raw_stream(channel, shards, 1024, probe, token)

            def read():
                try:
                    for message in call:
                        names.append(message.shm_name)
                except grpc.RpcError:  # cancelled below
                    pass

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            time.sleep(3.0)
            held = [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]
            assert names and all(names), names
            assert len(names) <= servicer.prefetch + 2 and len(held) == len(names)
            # open one as the client does: the server sends one more
            header, arrays = wire.decode_microbatch(open(os.path.join(SHM_DIR, names[0]), "rb").read())
            assert header.step == 0 and "tokens" in arrays
            os.unlink(os.path.join(SHM_DIR, names[0]))
            sent = len(names)
            deadline = time.monotonic() + 10
            while len(names) == sent and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(names) == sent + 1
            call.cancel()
            reader.join(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names):
            time.sleep(0.05)
        assert not [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]
    finally:
        server.stop(grace=0).wait()
        os.unlink(os.path.join(SHM_DIR, probe))


def test_a_starting_server_sweeps_what_a_killed_server_left():
    import subprocess
    import sys

    from preprocess_service.adapters.shmdelivery import sweep_orphans

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {"old_dead": f"dtmb_{dead.pid:08x}_{secrets.token_hex(12)}",
             "young_dead": f"dtmb_{dead.pid:08x}_{secrets.token_hex(12)}",
             "old_alive": f"dtmb_{os.getpid():08x}_{secrets.token_hex(12)}"}
    for what, name in names.items():
        path = os.path.join(SHM_DIR, name)
        with open(path, "wb") as f:
            f.write(b"x")
        if what.startswith("old"):
            os.utime(path, (time.time() - 3600, time.time() - 3600))
    try:
        assert sweep_orphans(min_age_s=60) >= 1
        left = {what for what, name in names.items() if os.path.exists(os.path.join(SHM_DIR, name))}
        assert left == {"young_dead", "old_alive"}
    finally:
        for name in names.values():
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))


def test_an_object_removed_before_the_client_took_it_is_sent_again(shards):
    """Someone cleans /dev/shm under a stream: the client resumes at the microbatch it lost, and
    every sample still arrives exactly once, in order."""
    server, address, _ = _serve()
    stop, deleted = threading.Event(), []

    def vandal():
        while not stop.is_set() and not deleted:
            for name in os.listdir(SHM_DIR):
                if name.startswith(f"dtmb_{os.getpid():08x}_"):
                    try:
                        os.unlink(os.path.join(SHM_DIR, name))
                        deleted.append(name)
                        break
                    except FileNotFoundError:
                        pass
            time.sleep(0.005)

    thread = threading.Thread(target=vandal, daemon=True)
    try:
        config = JobConfig(shards=(str(shards),), seq_len=1024, dp_size=1, num_microbatches=2, seed=9)
        with DataClient(address, config, 0, prefetch=1) as client:
            keys, steps = [], []
            for mb in client:
                if not thread.is_alive() and not deleted:
                    thread.start()
                time.sleep(0.05)  # a slow trainer: the server's objects wait for it
                keys += mb.sample_keys
                steps.append((mb.step, mb.microbatch_index))
            reconnects = client.num_reconnects
    finally:
        stop.set()
        server.stop(grace=0).wait()
    assert deleted and reconnects >= 1
    assert len(keys) == len(set(keys)) == 60
    assert steps == sorted(steps)
