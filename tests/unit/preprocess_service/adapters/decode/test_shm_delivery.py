"""Same-host delivery in shared memory (decode/shm.py, trainer/client.py): a real server
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
from preprocess_service.adapters.decode.shm import SHM_DIR
from preprocess_service.service.server import create_server
from preprocess_service.service.settings import ServiceSettings
from trainer import DataClient

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this platform")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    write_tiny_shards(root, num_shards=2, samples_per_shard=30)
    return root


def _serve(**limits):
    server, port, servicer = create_server("127.0.0.1:0", settings=ServiceSettings(**limits))
    return server, f"127.0.0.1:{port}", servicer


def _ours() -> set[str]:
    """This process's microbatch objects and probes (the servers here are in-process)."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith((f"dtmb_{os.getpid():08x}_", f"dtprobe_{os.getpid():08x}"))}


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


def _token(name: str) -> bytes:
    with open(os.path.join(SHM_DIR, name), "rb") as f:
        return f.read(16)


def test_a_client_that_takes_nothing_holds_at_most_the_window_and_its_objects_are_reclaimed(shards):
    """A raw call with a valid probe that never takes its lent objects: the server stops at its
    window (prefetch + 2) instead of running ahead. Taking one the way the protocol says (shared
    flock, token check, taken byte) lets it send one more; the service reuses that object only
    after the lock is gone, and when the call ends the untaken ones get a new token (a message
    still naming them is refused), and the server's stop removes them all."""
    import fcntl

    token = secrets.token_bytes(32)
    probe = _probe(token)
    server, address, servicer = _serve()
    messages: list[pb.Microbatch] = []
    try:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            call = _raw_stream(channel, shards, 1024, probe, token)

            def read():
                try:
                    for message in call:
                        messages.append(message)
                except grpc.RpcError:  # cancelled below
                    pass

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            # until the server has filled its window (seconds on a loaded machine), then a while
            # longer, in which a server that ran past its window would send more
            deadline = time.monotonic() + 60
            while len(messages) < servicer.prefetch + 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(1.0)
            assert messages and all(m.shm_name and len(m.shm_token) == 16 for m in messages)
            assert len(messages) <= servicer.prefetch + 2
            assert all(_token(m.shm_name) == m.shm_token for m in messages)  # none reused meanwhile
            first = messages[0]
            assert first.tensors and all(not t.data for t in first.tensors)  # the bytes are in the object
            # take the first as the client does: the server sends one more
            fd = os.open(os.path.join(SHM_DIR, first.shm_name), os.O_RDWR)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            with open(os.path.join(SHM_DIR, first.shm_name), "r+b") as f:
                data = bytearray(f.read(first.shm_nbytes))
                f.seek(16)
                f.write(b"\x01")
            arrays = wire.lent_views(first, np.frombuffer(data, dtype=np.uint8))
            assert arrays["tokens"].shape[1] == 1024 and arrays["pixels"].size > 0
            sent = len(messages)
            deadline = time.monotonic() + 10
            while len(messages) == sent and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(messages) == sent + 1
            time.sleep(0.5)
            assert _token(first.shm_name) == first.shm_token, "reused while the client held its lock"
            os.close(fd)  # let go: the service may reuse it from now on
            call.cancel()
            reader.join(timeout=10)
        untaken = messages[1:]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_token(m.shm_name) == m.shm_token for m in untaken):
            time.sleep(0.05)
        assert not [m.shm_name for m in untaken if _token(m.shm_name) == m.shm_token], "not invalidated"
    finally:
        server.stop(grace=0).wait()
        os.unlink(os.path.join(SHM_DIR, probe))
    assert not [m.shm_name for m in messages if os.path.exists(os.path.join(SHM_DIR, m.shm_name))]


def test_a_lent_object_reused_before_the_client_took_it_is_lost_to_it_not_misread(shards):
    """The client-side check: a message whose object now holds another token (the service took
    it back) is refused as lost (the stream resumes at it), never read as that other microbatch."""
    from trainer.client import _from_shared_memory

    token = secrets.token_bytes(32)
    probe = _probe(token)
    server, address, _ = _serve()
    try:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            call = _raw_stream(channel, shards, 1024, probe, token)
            message = next(call)
            stale = pb.Microbatch()
            stale.CopyFrom(message)
            stale.shm_token = bytes(16)
            with pytest.raises(FileNotFoundError, match="reused"):
                _from_shared_memory(wire.decode_microbatch(stale.SerializeToString())[0])
            header, arrays, _ = _from_shared_memory(wire.decode_microbatch(message.SerializeToString())[0])
            assert header.step == 0 and not header.tensors and arrays["tokens"].shape[1] == 1024
            for bad in ({"shm_offset": 1 << 40}, {"shape": [1 << 20, 1 << 20]}):
                broken = pb.Microbatch()
                broken.CopyFrom(message)
                tensor = broken.tensors[0]
                for field, value in bad.items():
                    if field == "shape":
                        del tensor.shape[:]
                        tensor.shape.extend(value)
                    else:
                        setattr(tensor, field, value)
                with pytest.raises(ValueError, match="does not lie"):
                    _from_shared_memory(wire.decode_microbatch(broken.SerializeToString())[0])
            del arrays, header
            call.cancel()
    finally:
        server.stop(grace=0).wait()
        os.unlink(os.path.join(SHM_DIR, probe))


def test_a_starting_server_sweeps_what_a_killed_server_left():
    import subprocess
    import sys

    from preprocess_service.adapters.decode.shm import sweep_orphans

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


def test_an_object_removed_before_the_client_took_it_is_sent_again(shards, monkeypatch):
    """Someone cleans /dev/shm under a stream (here: the objects of the 3rd and 4th messages, just
    before the client opens them): the client resumes at the microbatch it lost, the server stops
    lending an arena whose name is gone, and every sample still arrives exactly once, in order."""
    from trainer import client as client_module

    original, seen, deleted = client_module._from_shared_memory, [], []

    def vandal(header):
        seen.append(header.shm_name)
        if len(seen) in (3, 4):
            os.unlink(os.path.join(SHM_DIR, header.shm_name))
            deleted.append(header.shm_name)
        return original(header)

    monkeypatch.setattr(client_module, "_from_shared_memory", vandal)
    server, address, servicer = _serve()
    try:
        config = JobConfig(shards=(str(shards),), seq_len=1024, dp_size=1, num_microbatches=2, seed=9)
        with DataClient(address, config, 0, prefetch=1) as client:
            keys, steps = [], []
            for mb in client:
                time.sleep(0.05)  # a slow trainer: the server's objects wait for it
                keys += mb.sample_keys
                steps.append((mb.step, mb.microbatch_index))
            reconnects = client.num_reconnects
        assert not set(deleted) & set(seen[4:]), "an arena whose name was removed was lent again"
    finally:
        server.stop(grace=0).wait()
    assert len(deleted) == 2 and reconnects >= 1
    assert len(keys) == len(set(keys)) == 60
    assert steps == sorted(steps)
