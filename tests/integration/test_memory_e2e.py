"""The memory budget bounds the whole service, measured from outside: a real ``serve`` process
with its memory sampling on (memory_sample_s, the default), 16 client streams reading one job, and
the PSS of the server's whole process tree (server, fork server, decode workers, resource
tracker) read from /proc/PID/smaps_rollup every SAMPLE_EVERY_S. Its peak may pass the budget by
budget.PSS_HEADROOM at most.

The budget is tight: the job would hold more than it leaves for data. Every rank reads ahead
(DataClient prefetch) and then waits FIRST_STEP_S, as a trainer does while its first step
compiles, so with no budget the decoded microbatches pile up in the service's shared memory, well
past BUDGET_MIB plus the headroom. With it, streams are refused (RESOURCE_EXHAUSTED with a retry
hint, which DataClient honours) or wait for room; the test checks that this happened, and that
every sample still arrives once."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
import webdataset as wds

from disttrain_api import preprocess_pb2 as pb
from disttrain_api import preprocess_pb2_grpc as pb_grpc
from disttrain_api.config import JobConfig
from disttrain_api.spec import spec_from_config
from helpers import jpeg_bytes
from preprocess_service.adapters.infra.budget import PSS_HEADROOM
from trainer import DataClient

REPO = Path(__file__).resolve().parents[2]
NUM_RANKS = 16
NUM_SAMPLES = 192
SEQ_LEN = 2048
"""One large image per sequence (a microbatch is megabytes)."""
IMAGE_SIDES = (1000, 800)
BUDGET_MIB = 540
"""A little above the least the server accepts for its idle footprint (4/3 of it: budget.py), so
it leaves the streams less than the job would hold. Where the idle service is larger, the server
names the least it accepts and the test uses a tenth more."""
PREFETCH = 16
FIRST_STEP_S = 8.0
TRAIN_S = 0.05
SAMPLE_EVERY_S = 0.1


def _write_shards(root: Path, num_shards: int = 4) -> set[str]:
    """Shards of one large JPEG and a caption per sample (a few images, reused: decoding costs the
    same); returns the keys."""
    images = [jpeg_bytes(*(IMAGE_SIDES if i % 2 else IMAGE_SIDES[::-1]), seed=i) for i in range(8)]
    for shard in range(num_shards):
        with wds.TarWriter(str(root / f"{shard:05d}.tar")) as writer:
            for index in range(shard, NUM_SAMPLES, num_shards):
                writer.write({"__key__": f"{index:06d}", "jpg": images[index % len(images)],
                              "txt": f"caption {index}".encode()})
    return {f"{index:06d}" for index in range(NUM_SAMPLES)}


def _process_tree(root: int) -> list[int]:
    """``root`` and every descendant, from each process's parent in /proc/PID/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _pss(pid: int) -> int:
    """Pss of /proc/PID/smaps_rollup, bytes (0 once the process is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:100]
    except OSError:
        return "(gone)"


class TreeSampler(threading.Thread):
    """Samples the PSS of a process tree every SAMPLE_EVERY_S; keeps the peak and its breakdown."""

    def __init__(self, root: int):
        super().__init__(daemon=True, name="pss-sampler")
        self.root = root
        self.stop = threading.Event()
        self.peak = 0
        self.breakdown: dict[int, tuple[int, str]] = {}
        self.num_samples = 0

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_EVERY_S):
            parts = {pid: _pss(pid) for pid in _process_tree(self.root)}
            self.num_samples += 1
            if sum(parts.values()) > self.peak:
                self.peak = sum(parts.values())
                self.breakdown = {pid: (pss, _command(pid)) for pid, pss in parts.items()}

    def describe(self) -> str:
        return "\n".join(f"  pid {pid:>7}: {pss / 2**20:7.1f} MiB  {command}"
                         for pid, (pss, command) in sorted(self.breakdown.items(), key=lambda item: -item[1][0]))


def _start_server(budget_mib: int) -> tuple[subprocess.Popen, int, list[str]]:
    """A `serve` process with memory sampling on, warm (its decode workers up and their idle memory
    in the budget's baseline); its stderr lines collect in the returned list."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTTRAIN_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "preprocess_service", "serve", "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0", "--decode-workers", "2", "--max-streams-per-client", "0",
         "--memory-budget-bytes", str(budget_mib << 20), "--memory-wait-s", "60"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None and proc.stderr is not None
    stderr = proc.stderr
    log: list[str] = []
    warm = threading.Event()

    def read_log() -> None:
        for line in stderr:
            log.append(line)
            if "warm in" in line or "leaves too little" in line:
                warm.set()
        warm.set()
    threading.Thread(target=read_log, daemon=True).start()
    line = proc.stdout.readline()
    port = int(line.rsplit(":", 1)[1]) if "listening on 127.0.0.1:" in line else 0
    if port:
        warm.wait(180)
    return proc, port, log


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(20)


@pytest.fixture
def server():
    """(process, port, budget in MiB): BUDGET_MIB, or a tenth above the least the server accepts."""
    budget_mib = BUDGET_MIB
    # The planner's kernels compiled once per installation (numba's on-disk cache), as in any
    # deployment after its first start: a first-ever compile leaves LLVM's memory resident in the
    # server, above the idle footprint this tight budget is sized for.
    subprocess.run([sys.executable, "-c", "from preprocess_service.core import reorder; reorder.warm_up()"],
                   check=True, timeout=600)
    proc, port, log = _start_server(budget_mib)
    least = re.search(r"raise it to at least (\d+)", "".join(log))
    if least:
        _stop(proc)
        budget_mib = int(int(least.group(1)) * 1.1) >> 20
        proc, port, log = _start_server(budget_mib)
    try:
        assert port and any("warm in" in line for line in log), "the server did not start:\n" + "".join(log)
        assert not any("leaves too little" in line for line in log), "".join(log)
        yield proc, port, budget_mib
    finally:
        _stop(proc)


@pytest.mark.timeout(600)
def test_sixteen_streams_keep_the_whole_service_within_its_budget(tmp_path, server, caplog):
    proc, port, budget_mib = server
    keys = _write_shards(tmp_path)
    address = f"127.0.0.1:{port}"
    config = JobConfig(shards=(str(tmp_path),), seq_len=SEQ_LEN, dp_size=NUM_RANKS, num_microbatches=1)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    with grpc.insecure_channel(address) as channel:
        job_id = pb_grpc.PreprocessStub(channel).OpenJob(pb.OpenJobRequest(spec=spec_from_config(config)),
                                                          timeout=60).job_id
    delivered: Counter = Counter()
    errors: list[str] = []
    started = time.monotonic()

    def rank(r: int) -> None:
        try:
            with DataClient(address, job_id, r, prefetch=PREFETCH, reconnect_timeout_s=240) as client:
                for mb in client:
                    delivered.update(mb.sample_keys)
                    time.sleep(max(TRAIN_S, started + FIRST_STEP_S - time.monotonic()))
        except Exception as exc:  # reported with the others below
            errors.append(f"rank {r}: {type(exc).__name__}: {exc}")

    caplog.set_level(logging.INFO, logger="trainer")
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(NUM_RANKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sampler.stop.set()
    sampler.join()
    budget = budget_mib << 20
    limit = budget * (1 + PSS_HEADROOM)
    held_back = sum("RESOURCE_EXHAUSTED" in record.getMessage() for record in caplog.records)
    print(f"\n[memory e2e] peak PSS of the service {sampler.peak / 2**20:.1f} MiB of a {budget_mib} MiB budget "
          f"({sampler.peak / budget:.3f}x; limit {limit / 2**20:.1f} MiB with {PSS_HEADROOM:.0%} headroom); "
          f"{sampler.num_samples} samples; streams refused or cut for memory {held_back} times\n{sampler.describe()}")
    assert not errors, errors
    assert sampler.peak <= limit, (
        f"the service's PSS peaked at {sampler.peak / 2**20:.1f} MiB, above its {budget_mib} MiB budget plus "
        f"{PSS_HEADROOM:.0%} headroom ({limit / 2**20:.1f} MiB); per process at the peak:\n{sampler.describe()}")
    assert set(delivered) == keys and set(delivered.values()) == {1}, "a sample was lost or delivered twice"
    assert held_back, "the budget never held a stream back: too loose for this test to fail"
