"""Faults where it runs: partitions, slow and lossy links, dying and slow trainer ranks, each
checked against a history of every delivery and acknowledgement.

    sudo python bench/faults.py [--runs 3] [--faults redis-cut clients-cut ...] [--quick] [--json FILE]

The bench builds a network of namespaces on this machine (disttrain_tools/netlab.py: a router,
one namespace per node, traffic only between them): Redis, three replicas and the client ranks
each in their own, and two relays (disttrain_tools/impair.py) on replica 0's links, to Redis and
from the clients, which can make those links slow and lossy (this kernel has no netem). Each run
is one job (its own seed) of several epochs; every rank is a process that records each
microbatch it gets (step, microbatch, keys, replica, time) and each acknowledgement, and saves its
state at every step end, as a trainer checkpoints. One fault is injected at a random time for a
bounded time, then healed, and the run goes on to the end of the job. The verdict reads only the
history and the shards (tarfile, no code of ours):

- every key of the shards delivered exactly once per epoch (lost: fewer; repeated: more);
- a (rank, step, microbatch) delivered twice (a rank restarted from its checkpoint) has the same
  keys both times (else: conflicting); no rank gets a step it acknowledged again;
- the stall: the longest wait of any rank for a microbatch, beyond its own pace, from the fault
  until 30 s after the heal (the time to recover).

Exit status 1 if any key is lost or repeated, any microbatch conflicts or any acknowledged step
replays. Needs root for the namespaces; prints why and exits 0 when they cannot be made.
``--quick`` is one run of each fault on a small data set (the test suite's version), with short
fault windows and the timeouts that recovery waits on (client keepalive, a stream's wait on Redis)
shortened to fit them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))

import benchjson  # noqa: E402

from disttrain_api.config import JobConfig  # noqa: E402
from webservers import Nginx  # noqa: E402  (tests/ is on sys.path when this runs as a script)

FAULTS = {
    "redis-cut": "replica 0 cut from Redis; its clients still reach it",
    "clients-cut": "replica 0 cut from the clients; it still reaches Redis",
    "minority": "replica 0 of 3 cut from everything (a minority partition)",
    "slow-clients-link": "200 ms delay and 5% loss between the clients and replica 0",
    "slow-redis-link": "200 ms delay and 5% loss between replica 0 and Redis",
    "rank-kill": "rank 0 SIGKILLed mid-step; torchrun's elastic agent restarts the group from their checkpoints",
    "slow-rank": "rank 1 ten times slower than the others",
    "redis-failover": "the Redis primary cut from its replica, then killed: the Sentinel promotes the replica, "
                      "which lacks the last 1-2 s of writes",
    "cache-disk-full": "replica 0's shard cache disk (a tmpfs) filled to the last byte",
    "state-disk-full": "a single node's state_dir disk (a tmpfs) filled; the node killed and restarted on it",
}
PROMISES = {
    "redis-cut": "exactly-once; the replica's streams end within stream_redis_timeout_s (2 s) and their ranks "
                 "resume on another replica",
    "clients-cut": "exactly-once; a rank resumes on another replica once gRPC keepalive finds the link dead",
    "minority": "exactly-once; the majority serves on, the planning lease passes within lease_ttl_s",
    "slow-clients-link": "exactly-once; throughput of the affected ranks falls, nothing times out",
    "slow-redis-link": "exactly-once; steps commit more slowly",
    "rank-kill": "exactly-once per checkpoint: steps after the last acknowledgement are sent again with the same "
                 "keys, acknowledged steps never",
    "slow-rank": "exactly-once; the other ranks' streams are not held back by the slow one",
    "redis-failover": "exactly-once while planning is deterministic (no cost feedback): the lost steps are planned "
                      "again the same; the lost writes are said (log, disttrain_redis_lost_writes_total)",
    "cache-disk-full": "exactly-once; a shard that cannot be cached is streamed uncached, said in the log, no partial "
                       "file stays; the cache is used again once there is room",
    "state-disk-full": "exactly-once; acknowledgements go on, the failed saves are said (log, "
                       "disttrain_state_save_errors_total, status); a restart resumes from the last whole state and "
                       "plans the steps after it the same; saving resumes once there is room",
}
SAID = {"redis-failover": "lost acknowledged writes", "cache-disk-full": "cannot cache",
        "state-disk-full": "cannot save its state"}
"""What the service must say of the fault, in its log (and metrics): lines with this text."""
REDIS_PORT, SERVICE_PORT = 6379, 50051
SHORT = ("slow-clients-link", "slow-redis-link", "rank-kill", "cache-disk-full", "state-disk-full")
"""Faults whose effect shows at once: ``--quick`` gives them less time than the partitions, whose
recovery (a stream timing out, keepalive, a lease passing) takes seconds to show."""


# --- a client rank (a process in the clients' namespace) ----------------------------------------
def rank_main(args: argparse.Namespace) -> int:
    """One client rank (its rank from RANK): a plain process, or a torchrun worker that torchrun's
    elastic agent restarts when a worker of the group dies, resuming from the state it saved at its
    last step end."""
    import logging

    from trainer import DataClient

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # torchrun.out
    rank = int(os.environ["RANK"])
    fields = json.loads(args.config)
    config = JobConfig(**{**fields, "shards": tuple(fields["shards"])})
    out = Path(args.out)
    addresses = args.addresses.split(",")
    addresses = addresses[rank % len(addresses):] + addresses[:rank % len(addresses)]  # spread the ranks
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))  # what the rank-kill fault kills
    state_path, pace_path = out / f"rank{rank}.state.json", out / f"rank{rank}.pace"
    state = json.loads(state_path.read_text()) if state_path.exists() else None
    with open(out / f"rank{rank}.jsonl", "a") as history, \
            DataClient(addresses, config, rank, prefetch=2, reconnect_timeout_s=180, keepalive_s=args.keepalive) \
            as client:
        if state is not None:
            client.load_state_dict(state)
        history.write(json.dumps({"event": "start", "t": time.time(), "from_step": state["next_step"] if state else 0,
                                  "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}) + "\n")
        history.flush()
        for mb in client:
            pace = float(pace_path.read_text()) if pace_path.exists() else args.pace
            time.sleep(pace)  # the trainer's compute for this microbatch
            history.write(json.dumps({
                "t": time.time(), "rank": rank, "epoch": mb.epoch, "step": mb.step, "mb": mb.microbatch_index,
                "keys": list(mb.sample_keys), "skipped": [key for key, *_ in mb.skipped], "pace": pace,
                "replica": client.address}) + "\n")
            history.flush()
            if mb.microbatch_index + 1 == mb.num_microbatches:  # a checkpoint: state saved, then acknowledged
                saved = client.state_dict()
                tmp = state_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(saved))
                os.replace(tmp, state_path)
                client.acknowledge(saved["next_step"])
                history.write(json.dumps({"t": time.time(), "ack": saved["next_step"]}) + "\n")
                history.flush()
        if rank == 0:  # what the service reports skipped (at planning: never in a microbatch)
            history.write(json.dumps({"event": "report", "t": time.time(),
                                      "skipped": sorted({s.key for s in client.report().skipped})}) + "\n")
        history.write(json.dumps({"event": "done", "t": time.time()}) + "\n")
    return 0


# --- the cluster ---------------------------------------------------------------------------------
class Cluster:
    """The service's nodes in their namespaces, and nginx serving the shards (the replicas read them
    over HTTP, through their shard caches); the ranks are started per run. ``kind``:

    - "shared": Redis, three replicas, the relays on replica 0's links; replica 0's shard cache
      bounded at 2.2 times the largest shard (a job may hold half: one shard at a time), less than
      the shards, so it evicts and fetches again, on a tmpfs of 1.5 times that bound;
    - "sentinel": the same with a Redis primary and its replica under a Sentinel;
    - "solo": one node without Redis, its state_dir on a small tmpfs.

    Its nodes' names in the lab begin with ``name`` (clusters of one lab side by side);
    ``replica_args``: settings passed to every node."""

    def __init__(self, lab, workdir: Path, shards: list[str], *, kind: str = "shared", name: str = "",
                 replica_args: tuple[str, ...] = (), sentinel_down_after_ms: int = 1000, log=print):
        self.lab, self.workdir, self.log, self.kind = lab, workdir, log, kind
        self.sentinel_down_after_ms = sentinel_down_after_ms
        self.killed_at: float | None = None
        """time.time() when the redis-failover fault killed the primary."""
        self.name, self.replica_args = name, replica_args
        self.processes: list[subprocess.Popen] = []
        self.replicas: list = []
        self.sentinel = self.web = self.cache_dir = self.state_dir = None
        self.mounts: list[Path] = []
        self.relays: dict[str, subprocess.Popen] = {}
        try:
            self._start(shards)
        except BaseException:
            self.close()  # nothing left running in namespaces about to go
            raise

    def node(self, name: str) -> str:
        """The lab's name of this cluster's node ``name``."""
        return self.name + name

    def _add(self, name: str) -> str:
        return self.lab.add(self.node(name))

    def _prefix(self, name: str) -> tuple[str, ...]:
        return tuple(self.lab.exec_prefix(self.node(name)))

    def _start(self, shards: list[str]) -> None:
        from disttrain_tools.localcluster import LocalSentinel, Replica

        workdir = self.workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.clients_ip = self._add("clients")
        web_ip = self._add("web")
        self.web = Nginx(Path(shards[0]).parent, workdir / "web", host=web_ip, port=80, prefix=self._prefix("web"))
        self.shard_urls = [f"{self.web.url}/{Path(shard).name}" for shard in shards]
        if self.kind == "solo":
            self.state_dir = self._tmpfs("state-disk", 4 << 20)
            replica = Replica(None, port=SERVICE_PORT, host=self._add("solo"), prefix=self._prefix("solo"),
                              log_path=workdir / "solo.log",
                              extra_args=("--state-dir", str(self.state_dir), *self.replica_args))
            self.replicas.append(replica.start(timeout_s=180))
            self.addresses = [replica.address]
            return
        redis_ip = self._add("redis")
        replica_ips = [self._add(f"rep{i}") for i in range(3)]
        relay_redis, relay_clients = self._add("link-r0"), self._add("link-c0")
        self.redis = self._redis_server("redis", redis_ip)
        if self.kind == "sentinel":  # a primary with one replica under a Sentinel; the replicas ask it where it is
            self._redis_server("redis2", self._add("redis2"), "--replicaof", redis_ip, str(REDIS_PORT))
            sentinel_ip = self._add("sentinel")
            self.sentinel = LocalSentinel(workdir / "sentinel", REDIS_PORT, port=26379, master_host=redis_ip,
                                          host=sentinel_ip, prefix=self._prefix("sentinel"),
                                          down_after_ms=self.sentinel_down_after_ms).start(30)
        python = sys.executable
        self.relays = {
            "redis": self._spawn("link-r0", [python, "-m", "disttrain_tools.impair", "--listen",
                                             f"{relay_redis}:{REDIS_PORT}", "--to", f"{redis_ip}:{REDIS_PORT}"]),
            "clients": self._spawn("link-c0", [python, "-m", "disttrain_tools.impair", "--listen",
                                               f"{relay_clients}:{SERVICE_PORT}", "--to",
                                               f"{replica_ips[0]}:{SERVICE_PORT}", "--seed", "1"]),
        }
        # replica 0's cache: room for a job's share (half) to hold the largest shard, not for all of them
        largest = max(os.path.getsize(shard) for shard in shards)
        cache_bytes = largest * 22 // 10
        if cache_bytes >= sum(os.path.getsize(shard) for shard in shards):
            raise ValueError("the shards fit replica 0's shard cache: the cache-disk-full fault needs more of them")
        self.cache_dir = self._tmpfs("cache-disk", cache_bytes * 3 // 2)
        time.sleep(1.0)
        for i, ip in enumerate(replica_ips):
            direct = f"redis://{relay_redis if i == 0 else redis_ip}:{REDIS_PORT}/0"
            url = self.sentinel.url if self.sentinel else direct
            cache = ("--shard-cache-dir", str(self.cache_dir), "--shard-cache-bytes", str(cache_bytes)) \
                if i == 0 else ()
            replica = Replica(url, port=SERVICE_PORT, host=ip, prefix=self._prefix(f"rep{i}"),
                              log_path=workdir / f"rep{i}.log",
                              extra_args=("--lease-ttl", "2", *cache, *self.replica_args))
            replica.start(wait=False)
            self.replicas.append(replica)
        for replica in self.replicas:
            replica.wait_ready(timeout_s=180)
        # the clients reach replica 0 through its relay, the others directly
        self.addresses = [f"{relay_clients}:{SERVICE_PORT}"] + [f"{ip}:{SERVICE_PORT}" for ip in replica_ips[1:]]

    def _tmpfs(self, name: str, size: int) -> Path:
        """A small disk of its own (mounted before the node starts: its namespace sees it too)."""
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"cannot mount a tmpfs on {path}: {done.stderr.strip()}")
        self.mounts.append(path)
        return path

    def _redis_server(self, node: str, ip: str, *args: str) -> subprocess.Popen:
        data = self.workdir / node
        data.mkdir(parents=True, exist_ok=True)
        return self._spawn(node, ["redis-server", "--port", str(REDIS_PORT), "--bind", ip, "--protected-mode", "no",
                                  "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--dir", str(data),
                                  *args])

    def _spawn(self, node: str, command: list[str]) -> subprocess.Popen:
        with open(self.workdir / f"{node}.out", "ab") as log:
            process = subprocess.Popen(list(self._prefix(node)) + command, stdout=log, stderr=subprocess.STDOUT,
                                       cwd=REPO)
        self.processes.append(process)
        return process

    def start_ranks(self, num_ranks: int, config: dict, out: Path, pace: float, keepalive_s: float = 2.0,
                    torchrun: bool = False) -> subprocess.Popen | RankGroup:
        """The ranks, each in a session of its own so that nothing of them outlives the run: as one
        torchrun (its elastic agent restarts the group when a worker dies) where a fault kills one,
        else as plain processes (a torchrun's agent would only add its own start and imports)."""
        rank = [str(REPO / "bench" / "faults.py"), "rank", "--addresses", ",".join(self.addresses),
                "--config", json.dumps(config), "--out", str(out), "--pace", str(pace), "--keepalive", str(keepalive_s)]
        prefix, env = list(self._prefix("clients")), {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(out / "torchrun.out", "ab") as log:  # each child has its own copy
            if not torchrun:
                return RankGroup([subprocess.Popen(prefix + [sys.executable, *rank], stdout=log,
                                                   stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                                   env={**env, "RANK": str(r), "WORLD_SIZE": str(num_ranks)})
                                  for r in range(num_ranks)])
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                       "--nproc-per-node", str(num_ranks), "--max-restarts", "3", "--monitor-interval", "0.2", *rank]
            return subprocess.Popen(prefix + command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                    start_new_session=True)

    def log_sizes(self) -> dict[Path, int]:
        """Where each node's log ends now (what a run says is read from there on)."""
        return {r.log_path: r.log_path.stat().st_size if r.log_path.exists() else 0 for r in self.replicas}

    def said(self, since: dict[Path, int], text: str, job_id: str | None = None) -> int:
        """Lines with ``text`` (and ``job_id``) the nodes logged since ``since``."""
        count = 0
        for path, offset in since.items():
            with open(path, "rb") as f:
                f.seek(offset)
                lines = f.read().decode(errors="replace").splitlines()
            count += sum(1 for line in lines if text in line and (job_id is None or job_id in line))
        return count

    def close(self) -> None:
        try:
            for replica in self.replicas:
                replica.kill()
            if self.sentinel is not None:
                self.sentinel.stop()
            for process in self.processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=30)
            if self.web is not None:
                self.web.close()
        finally:  # whatever failed above, no disk of ours stays mounted
            for path in self.mounts:
                done = subprocess.run(["umount", "-l", str(path)], capture_output=True, text=True)
                if done.returncode != 0:
                    self.log(f"  cannot unmount {path}: {done.stderr.strip()}")


class RankGroup:
    """Plain rank processes, waited on as one (the part of Popen that run_fault uses): its return
    code is the first non-zero one of theirs, else 0 once all have exited."""

    def __init__(self, processes: list[subprocess.Popen]):
        self.processes = processes

    @property
    def returncode(self) -> int | None:
        codes = [p.returncode for p in self.processes]
        failed = [c for c in codes if c not in (None, 0)]
        return failed[0] if failed else (None if None in codes else 0)

    def poll(self) -> int | None:
        for process in self.processes:
            process.poll()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for process in self.processes:
            process.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        return self.returncode

    def terminate(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()

    def kill_sessions(self) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


def kill_ranks(agent: subprocess.Popen | RankGroup, out: Path) -> None:
    """The ranks (torchrun and every worker it started; none outlives its run): SIGTERM (torchrun
    stops its workers, each in a session of its own), then SIGKILL to anything of the run left."""
    if agent.poll() is None:
        agent.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=15)
    if isinstance(agent, RankGroup):
        agent.kill_sessions()
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
    for proc in Path("/proc").iterdir():  # a worker of this run (its --out) that is still there
        with contextlib.suppress(ValueError, OSError):
            if str(out).encode() in (proc / "cmdline").read_bytes() and int(proc.name) != os.getpid():
                os.kill(int(proc.name), signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        agent.wait(timeout=30)


class Filler:
    """Keeps ``disk`` full, as another tenant of the disk would: writes a file until ENOSPC, and
    again whenever room appears (a file removed, a shard evicted) until ``stop()``, which removes it."""

    def __init__(self, disk: Path):
        self.path = disk / "filler"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self._stop = threading.Event()
        self._top_up()
        self._thread = threading.Thread(target=self._keep_full, daemon=True)
        self._thread.start()

    def _top_up(self) -> None:
        for chunk in (bytes(1 << 20), bytes(4096), b"\0"):
            try:
                while True:
                    os.write(self._fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise

    def _keep_full(self) -> None:
        while not self._stop.wait(0.02):
            self._top_up()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        os.close(self._fd)
        self.path.unlink()


# --- faults --------------------------------------------------------------------------------------
def inject(fault: str, cluster: Cluster, agent: subprocess.Popen | RankGroup, rng: random.Random, out: Path,
           pace: float, job_id: str):
    """Starts ``fault`` on the job ``job_id``'s cluster; returns what heals it."""
    lab, node = cluster.lab, cluster.node
    if fault == "redis-cut":
        lab.cut(node("rep0"), node("link-r0"))
        return lambda: lab.heal(node("rep0"), node("link-r0"))
    if fault == "clients-cut":
        lab.cut(node("clients"), node("link-c0"))
        return lambda: lab.heal(node("clients"), node("link-c0"))
    if fault == "minority":
        lab.isolate(node("rep0"))
        return lambda: lab.heal(node("rep0"))
    if fault in ("slow-clients-link", "slow-redis-link"):
        relay = cluster.relays["clients" if fault == "slow-clients-link" else "redis"]
        relay.send_signal(signal.SIGUSR1)
        return lambda: relay.send_signal(signal.SIGUSR2)
    if fault == "redis-failover":
        lab.cut(node("redis"), node("redis2"))  # replication stops; the primary goes on taking writes
        time.sleep(rng.uniform(1.0, 2.0))
        _wait_for_unreplicated_commits(lab, node("redis"), node("redis2"), job_id)
        # then its machine is gone, with them (kept cut off: its kernel would still send what the
        # dead process had buffered); the Sentinel promotes a replica that never got them
        lab.isolate(node("redis"))
        cluster.redis.kill()
        cluster.killed_at = time.time()
        cluster.redis.wait(timeout=30)
        return lambda: lab.heal(node("redis"))
    if fault == "rank-kill":  # torchrun sees the worker die and restarts the group from their checkpoints
        os.kill(int((out / "rank0.pid").read_text()), signal.SIGKILL)
        return lambda: None
    if fault == "slow-rank":
        (out / "rank1.pace").write_text(str(pace * 10))
        return lambda: (out / "rank1.pace").unlink()
    if fault == "cache-disk-full":
        return Filler(cluster.cache_dir).stop
    if fault == "state-disk-full":  # the node dies while its disk is full and restarts on it
        since = cluster.log_sizes()
        filler = Filler(cluster.state_dir)
        # it dies after a save the full disk refused (an acknowledgement comes every step or so; a
        # loaded machine may take seconds for one), at a random moment after
        deadline = time.monotonic() + 60
        while not cluster.said(since, SAID[fault]) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(rng.uniform(0.0, 2.0))
        node = cluster.replicas[0]
        node.kill()
        node.start(timeout_s=180)
        return filler.stop
    raise ValueError(f"unknown fault {fault!r}")


def _frontier(lab, name: str, job_id: str) -> int:
    """How many steps of ``job_id`` the Redis on node ``name`` holds committed."""
    done = subprocess.run([*lab.exec_prefix(name), "redis-cli", "-h", lab.address(name), "-p", str(REDIS_PORT),
                           "get", "disttrain:{" + job_id + "}:frontier"],
                          capture_output=True, text=True, timeout=10)
    return int(done.stdout.strip() or 0)


def _wait_for_unreplicated_commits(lab, primary: str, replica: str, job_id: str, timeout_s: float = 20.0) -> None:
    """Until the primary holds committed plans its cut-off replica lacks (on a loaded machine the
    job may commit nothing for a while; other writes lost, a lease or an acknowledgement, are
    written again by their next renewal): the failover then loses them, which the service must say."""
    deadline = time.monotonic() + timeout_s
    while _frontier(lab, primary, job_id) <= _frontier(lab, replica, job_id) and time.monotonic() < deadline:
        time.sleep(0.2)


def shard_keys(shards: list[str]) -> set[str]:
    """The sample keys of the shards, read with tarfile (the verdict's own reading)."""
    keys = set()
    for shard in shards:
        with tarfile.open(shard) as tar:
            keys |= {member.name.split("/")[-1].split(".")[0] for member in tar.getmembers() if member.isfile()}
    return keys


def verdict(out: Path, num_ranks: int, keys: set[str], epochs: int, fault_at: float, healed_at: float) -> dict:
    """Reads the ranks' histories; see the module docstring for what each figure means."""
    slots: dict[tuple[int, int, int], tuple] = {}
    conflicting = acked_replayed = replayed = 0
    stall = 0.0
    done = moved = 0
    reported: set[str] = set()
    extra: collections.Counter = collections.Counter()
    replicas = collections.Counter()
    back, restarts = 0.0, 0
    for rank in range(num_ranks):
        acked, last_t, before, during, life, restarted = 0, None, None, set(), 0, False
        for line in (out / f"rank{rank}.jsonl").read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the last line of a rank SIGKILLed while writing it
                continue
            if record.get("event") == "start":
                last_t = record["t"]  # a restarted rank waits for its first microbatch from here
                life += 1  # what an earlier life got may come again; the same life gets each slot once
                restarted = life > 1 and record["t"] >= fault_at
                continue
            if record.get("event") == "done":
                done += 1
                continue
            if record.get("event") == "report":
                reported |= set(record["skipped"])
                continue
            if "ack" in record:
                acked = max(acked, record["ack"])
                continue
            t = record["t"]
            if restarted:  # the first microbatch of a life begun after the fault: the rank is back
                back, restarted = max(back, t - fault_at), False
            if last_t is not None and t >= fault_at and last_t <= healed_at + 30:
                stall = max(stall, t - last_t - record["pace"])
            last_t = t
            replicas[record["replica"]] += 1
            if t < fault_at:
                before = record["replica"]
            elif t < healed_at:
                during.add(record["replica"])
            if record["step"] < acked:
                acked_replayed += 1
            slot = (rank, record["step"], record["mb"])
            content = tuple(record["keys"]) + tuple(record["skipped"])
            if slot in slots:
                first, first_life = slots[slot]
                if first_life == life:  # twice to one client: a double delivery, not a replay
                    extra.update(content)
                    continue
                replayed += 1
                conflicting += first != content
                continue
            slots[slot] = (content, life)
        moved += bool(during - {before})
        restarts += max(life - 1, 0)
    counts = collections.Counter(key for content, _ in slots.values() for key in content) + extra
    # a sample the service reports skipped and never put in a microbatch was left out when planning
    planning_skips = {key for key in reported if key in keys and not counts.get(key)}
    keys = keys - planning_skips
    lost = sum(max(epochs - counts.get(key, 0), 0) for key in keys)
    repeated = sum(max(count - epochs, 0) if key in keys else count for key, count in counts.items())
    return {"keys_expected": len(keys) * epochs, "keys_skipped_when_planning": len(planning_skips),
            "keys_delivered": sum(counts.values()), "keys_lost": lost,
            "keys_repeated": repeated, "conflicting_microbatches": conflicting,
            "acknowledged_steps_replayed": acked_replayed, "microbatches_replayed_after_restart": replayed,
            "ranks_finished": done, "stall_s": round(max(stall, 0.0), 2),
            "ranks_back_s": round(back, 2) if back else None, "rank_restarts": restarts,
            "replicas_used": len(replicas),
            "ranks_moved_during_fault": moved}


def run_fault(cluster: Cluster, fault: str, *, seed: int, shards: list[str], epochs: int, num_ranks: int,
              pace: float, duration_s: float, workdir: Path, keepalive_s: float = 2.0, log=print) -> dict:
    rng = random.Random(seed)
    out = workdir / f"{fault}-{seed}"
    out.mkdir(parents=True)
    config = {"shards": cluster.shard_urls, "seq_len": 4096, "dp_size": num_ranks, "num_microbatches": 2,
              "seqs_per_microbatch": 1, "seed": seed, "num_epochs": epochs}
    job_id = JobConfig(**{**config, "shards": tuple(config["shards"])}).job_id()
    since = cluster.log_sizes()
    agent = cluster.start_ranks(num_ranks, config, out, pace, keepalive_s, torchrun=fault == "rank-kill")
    try:
        deadline = time.monotonic() + 240
        while not all(_delivered(out, rank) >= 2 for rank in range(num_ranks)):  # every rank streaming
            if time.monotonic() > deadline or agent.poll() not in (None, 0):
                raise RuntimeError(f"{fault}: ranks did not start streaming (see {out})")
            time.sleep(0.1)
        time.sleep(rng.uniform(0.2, 2.0))
        fault_at = time.time()
        heal = inject(fault, cluster, agent, rng, out, pace, job_id)
        time.sleep(duration_s)
        heal()
        healed_at = time.time()
        log(f"  {fault}: injected for {healed_at - fault_at:.1f} s, healed; waiting for the job to end")
        try:
            agent.wait(timeout=300)
        except subprocess.TimeoutExpired:
            log(f"  {fault}: the ranks did not finish within 300 s of the heal (killed)")
    finally:
        kill_ranks(agent, out)
    result = verdict(out, num_ranks, shard_keys(shards), epochs, fault_at, healed_at)
    result["fault_s"] = round(healed_at - fault_at, 1)
    result["ranks_exit"] = agent.returncode
    result["said"] = cluster.said(since, SAID[fault], job_id if fault == "redis-failover" else None) \
        if fault in SAID else None
    if fault == "redis-failover":  # the Sentinel's own share of the stall: from the kill to its +switch-master
        switched = _sentinel_switched_at(cluster.sentinel.work_dir / "sentinel.log")
        result["sentinel_failover_s"] = round(switched - cluster.killed_at, 2) \
            if switched is not None and cluster.killed_at is not None else None
    if fault == "state-disk-full":
        # the state on the disk comes to stand at the step every rank acknowledged last: saved again
        # (by itself, within its retry back-off, when the job ended while the disk was full)
        result["last_acked"] = _last_acked(out, num_ranks)
        deadline = time.monotonic() + 30
        while True:
            saved = json.loads((cluster.state_dir / f"{job_id}.json").read_text())
            if saved.get("acked_step") == result["last_acked"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        result["state_saved_at"] = saved.get("acked_step")
        result["state_saved_again"] = result["state_saved_at"] == result["last_acked"]
        result["acked_after_heal"] = _acks_after(out, num_ranks, healed_at)
        result["resumed_from_saved_state"] = cluster.said(since, "resumed from", job_id)
    if fault == "cache-disk-full":  # shards cached since the heal: the cache is used again
        result["cached_after_heal"] = sum(1 for f in cluster.cache_dir.rglob("*.tar") if f.stat().st_mtime >= healed_at)
    disk = {"cache-disk-full": cluster.cache_dir, "state-disk-full": cluster.state_dir}.get(fault)
    if disk is not None:  # a write the full disk cut short is not left (one under way may be, for a moment)
        deadline = time.monotonic() + 30
        while (partial := _partial_files(disk)) and time.monotonic() < deadline:
            time.sleep(0.5)
        result["partial_files_left"] = len(partial)
    return result


def _sentinel_switched_at(log_path: Path) -> float | None:
    """time.time() of the Sentinel's last +switch-master (its log: "PID:X 29 Nov 2026 12:03:06.746 #
    +switch-master ..."; local time, as time.mktime reads it)."""
    found = None
    with contextlib.suppress(OSError):
        for line in log_path.read_text(errors="replace").splitlines():
            if "+switch-master" in line:
                with contextlib.suppress(ValueError, IndexError):
                    stamp = " ".join(line.split()[1:5])  # 29 Nov 2026 12:03:06.746
                    whole, _, millis = stamp.rpartition(".")
                    found = time.mktime(time.strptime(whole, "%d %b %Y %H:%M:%S")) + int(millis) / 1000
    return found


def _partial_files(disk: Path) -> list[Path]:
    return [f for f in disk.rglob("*") if f.name.endswith((".part", ".tmp"))]


def _last_acked(out: Path, num_ranks: int) -> int:
    """The step every rank acknowledged last (the lowest of their last acknowledgements)."""
    last = []
    for rank in range(num_ranks):
        acks = [0]
        for line in (out / f"rank{rank}.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if "ack" in record:
                    acks.append(record["ack"])
        last.append(max(acks))
    return min(last)


def _acks_after(out: Path, num_ranks: int, t: float) -> int:
    """Acknowledgements the ranks made after ``t``."""
    count = 0
    for rank in range(num_ranks):
        for line in (out / f"rank{rank}.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                count += "ack" in record and record["t"] > t
    return count


def _delivered(out: Path, rank: int) -> int:
    path = out / f"rank{rank}.jsonl"
    return sum(1 for line in path.read_text().splitlines() if '"step"' in line) if path.exists() else 0


class SharedLab:
    """A NetLab that clusters in threads of their own share: nodes are added and links cut one
    call at a time (everything else passes through)."""

    def __init__(self, lab):
        self._lab, self._lock = lab, threading.Lock()

    def __getattr__(self, name: str):
        attr = getattr(self._lab, name)
        if name not in ("add", "cut", "isolate", "heal"):
            return attr

        def locked(*args, **kwargs):
            with self._lock:
                return attr(*args, **kwargs)
        return locked


def faults(*, names: list[str], runs: int, shards: list[str], epochs: int, num_ranks: int, pace: float,
           duration_s: tuple[float, float], slow_rank_s: float, short_s: float = 1e9, seed: int = 0,
           keepalive_s: float = 2.0, replica_args: tuple[str, ...] = (), sentinel_down_after_ms: int = 1000,
           log=print) -> dict:
    """Runs each fault ``runs`` times. The faults of the shared cluster run one after another (each
    acts on replica 0 or its links); the redis-failover and state-disk-full runs each have a
    cluster of their own, and those clusters run at the same time as the shared one (one lab,
    nodes of their own: no fault reaches another cluster's nodes)."""
    from disttrain_tools import netlab

    rng = random.Random(seed)
    workdir = Path(tempfile.mkdtemp(prefix="disttrain-faults-"))
    results: dict[str, list[dict]] = {name: [None] * runs for name in names}
    own = {"redis-failover": "sentinel", "state-disk-full": "solo"}  # a fresh cluster of their own each run
    shared = [name for name in names if name not in own]
    # every random draw made here, in one order, whatever the threads below do first
    order = [rng.sample(shared, len(shared)) for _ in range(runs)]  # a random order each round
    seconds = {(name, run): slow_rank_s if name == "slow-rank" else rng.uniform(*duration_s)
               for name in names for run in range(runs)}
    started = time.monotonic()

    def one(cluster: Cluster, name: str, run: int) -> None:
        duration = min(seconds[name, run], short_s) if name in SHORT else seconds[name, run]
        began = time.monotonic()
        result = run_fault(cluster, name, seed=seed * 1000 + run * 100 + list(FAULTS).index(name), shards=shards,
                           epochs=epochs, num_ranks=num_ranks, pace=pace, duration_s=duration, workdir=workdir,
                           keepalive_s=keepalive_s, log=log)
        log(f"  {name} run {run + 1} ({time.monotonic() - began:.0f} s, at {time.monotonic() - started:.0f} s): "
            + ", ".join(f"{k} {v}" for k, v in result.items()))
        results[name][run] = result

    def shared_runs(lab) -> None:
        cluster = Cluster(lab, workdir / "cluster", shards, replica_args=replica_args, log=log)
        try:
            for run in range(runs):
                for name in order[run]:
                    one(cluster, name, run)
        finally:
            cluster.close()

    def own_runs(lab, name: str) -> None:
        for run in range(runs):
            cluster = Cluster(lab, workdir / f"{own[name]}-{run}", shards, kind=own[name],
                              name=f"{own[name][:2]}{run}-", replica_args=replica_args,
                              sentinel_down_after_ms=sentinel_down_after_ms, log=log)
            try:
                one(cluster, name, run)
            finally:
                cluster.close()

    with netlab.NetLab() as plain:
        lab = SharedLab(plain)
        bodies = ([lambda: shared_runs(lab)] if shared else []) \
            + [lambda name=name: own_runs(lab, name) for name in own if name in names]
        errors: list[BaseException] = []

        def guarded(body) -> None:
            try:
                body()
            except BaseException as exc:  # raised below, once every cluster is closed
                errors.append(exc)
        threads = [threading.Thread(target=guarded, args=(body,)) for body in bodies]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
    return {"workdir": str(workdir), "results": results}


def summary(results: dict[str, list[dict]]) -> list[list]:
    rows = []
    for name, runs in results.items():
        stalls = [r["stall_s"] for r in runs]
        backs = [r["ranks_back_s"] for r in runs if r.get("ranks_back_s") is not None]
        said = [r["said"] for r in runs if r.get("said") is not None]
        rows.append([name, len(runs), sum(r["keys_lost"] for r in runs), sum(r["keys_repeated"] for r in runs),
                     sum(r["conflicting_microbatches"] for r in runs),
                     sum(r["acknowledged_steps_replayed"] for r in runs),
                     round(statistics.median(stalls), 2) if stalls else None, max(stalls, default=None),
                     round(statistics.median(backs), 2) if backs else None,
                     f"{sum(1 for n in said if n)}/{len(said)}" if said else None, PROMISES[name]])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    rank = sub.add_parser("rank", help="(internal) one client rank, a torchrun worker")
    rank.add_argument("--addresses", required=True)
    rank.add_argument("--config", required=True)
    rank.add_argument("--out", required=True)
    rank.add_argument("--pace", type=float, default=0.2)
    rank.add_argument("--keepalive", type=float, default=2.0, help="seconds between the client's keepalive pings")
    parser.add_argument("--faults", nargs="+", choices=list(FAULTS), default=list(FAULTS))
    parser.add_argument("--runs", type=int, default=3, help="runs of each fault, in a random order each round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="one run of each fault, a few seconds each, small data")
    parser.add_argument("--sentinel-down-after-ms", type=int, default=None,
                        help="the Sentinel's down-after-milliseconds in the redis-failover fault: how long the "
                             "primary must not answer before a failover (an operator's setting; Redis's default is "
                             "30000): 500 by default, 1000 with --quick (the suite's machine is loaded)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.command == "rank":
        return rank_main(args)

    from disttrain_tools import netlab

    reason = netlab.unavailable()
    if reason is not None:
        print(f"faults: skipped: {reason}")
        return 0
    if args.quick:  # the test suite's: short windows, and timeouts to match, so that a fault's recovery shows
        runs, shards, epochs, pace, duration, slow_rank_s = 1, benchjson.quick_shards(4, 20), 6, 0.1, (5.0, 5.0), 2.0
        short_s = 2.0
        # a cut link found dead within ~4 s (pings every 2 s, 2 s to answer); a stream cut from Redis
        # ends within 1.5 s: both within the 5 s partitions
        keepalive_s, replica_args = 2.0, ("--stream-redis-timeout-s", "1.5")
    else:
        shards = benchjson.quick_shards(4, 50)
        runs, epochs, pace, duration, slow_rank_s, short_s = args.runs, 16, 0.1, (8.0, 15.0), 60.0, 1e9
        keepalive_s, replica_args = 2.0, ()  # the client's default
    down_after_ms = args.sentinel_down_after_ms or (1000 if args.quick else 500)
    print(f"faults: {', '.join(args.faults)}; {runs} run(s) each, {epochs} epochs of {len(shard_keys(shards))} "
          f"samples, 3 replicas, 2 ranks")
    figures = faults(names=args.faults, runs=runs, shards=shards, epochs=epochs, num_ranks=2, pace=pace,
                     duration_s=duration, slow_rank_s=slow_rank_s, short_s=short_s, seed=args.seed,
                     keepalive_s=keepalive_s, replica_args=replica_args, sentinel_down_after_ms=down_after_ms)
    rows = summary(figures["results"])
    header = ["fault", "runs", "keys lost", "keys repeated", "conflicting microbatches", "acked steps replayed",
              "stall s (median)", "stall s (worst)", "restarted ranks back s (median)", "runs that said it",
              "promise"]
    print("  " + " | ".join(header[:-1]))
    for row in rows:
        print("  " + " | ".join(str(v) for v in row[:-1]))
    failovers = [r for r in figures["results"].get("redis-failover", []) if r.get("sentinel_failover_s") is not None]
    sentinel_note = []
    if failovers:  # the stall's share that is the Sentinel's own: detection (down-after) and promotion
        own = statistics.median(r["sentinel_failover_s"] for r in failovers)
        sentinel_note = [f"redis-failover: the Sentinel (down-after-milliseconds {down_after_ms}) named the new "
                         f"primary {own:.2f} s (median) after the kill; the stall's median "
                         f"{statistics.median(r['stall_s'] for r in failovers):.2f} s includes it"]
        print("  " + sentinel_note[0])
    doc = benchjson.document("faults", quick=args.quick) | {"results": figures["results"]}
    doc["tables"].append(benchjson.table(
        "faults: 3 replicas on one Redis, 2 ranks, each fault injected at a random time and healed",
        header, rows, notes=[f"{name}: {text}" for name, text in FAULTS.items() if name in args.faults]
        + ["stall: the longest wait of any rank for a microbatch beyond its own pace, from the fault until 30 s "
           "after the heal (a restarted rank's from its start)",
           "restarted ranks back: from the kill to the first microbatch of every restarted rank (torchrun's "
           "restart, the imports, the resume)",
           "runs that said it: runs whose service logged the fault (lost writes, a shard not cached, a state not "
           "saved)", "verdict from the ranks' histories and the shards read with tarfile", *sentinel_note]))
    benchjson.write(args.json, doc)
    bad = any(row[2] or row[3] or row[4] or row[5] for row in rows)
    unfinished = [name for name, runs_ in figures["results"].items() for r in runs_ if r["ranks_finished"] < 2]
    if unfinished:
        print(f"faults: ranks did not finish in {unfinished}")
    partial = [name for name, runs_ in figures["results"].items() for r in runs_ if r.get("partial_files_left")]
    if partial:
        print(f"faults: a full disk left partial files in {partial}")
    unsaved = [r for r in figures["results"].get("state-disk-full", []) if not r["state_saved_again"]]
    if unsaved:
        print("faults: the state was not saved again once its disk had room")
    crashed = [name for name, runs_ in figures["results"].items() for r in runs_
               if (r["rank_restarts"] and name != "rank-kill") or r["ranks_exit"] != 0]
    if crashed:
        print(f"faults: a rank crashed (exited with an error, or torchrun restarted it) in {crashed}")
    return 1 if bad or unfinished or partial or unsaved or crashed else 0


if __name__ == "__main__":
    sys.exit(main())
