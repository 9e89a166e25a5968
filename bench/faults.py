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
``--quick`` is one run of each fault on a small data set (the test suite's version).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import benchjson  # noqa: E402

from disttrain_api.config import JobConfig  # noqa: E402

FAULTS = {
    "redis-cut": "replica 0 cut from Redis; its clients still reach it",
    "clients-cut": "replica 0 cut from the clients; it still reaches Redis",
    "minority": "replica 0 of 3 cut from everything (a minority partition)",
    "slow-clients-link": "200 ms delay and 5% loss between the clients and replica 0",
    "slow-redis-link": "200 ms delay and 5% loss between replica 0 and Redis",
    "rank-kill": "rank 0 SIGKILLed mid-step, restarted from its last checkpoint",
    "slow-rank": "rank 1 ten times slower than the others",
    "redis-failover": "the Redis primary cut from its replica, then killed: the Sentinel promotes the replica, "
                      "which lacks the last 1-2 s of writes",
}
PROMISES = {
    "redis-cut": "exactly-once; the replica's streams end within stream_redis_timeout_s (3 s) and their ranks "
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
}
REDIS_PORT, SERVICE_PORT = 6379, 50051
SHORT = ("slow-clients-link", "slow-redis-link", "rank-kill")
"""Faults whose effect shows at once: ``--quick`` gives them less time than the partitions, whose
recovery (a stream timing out, keepalive, a lease passing) takes seconds to show."""


# --- a client rank (a process in the clients' namespace) ----------------------------------------
def rank_main(args: argparse.Namespace) -> int:
    import logging

    from trainer import DataClient

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # rankN.out
    fields = json.loads(args.config)
    config = JobConfig(**{**fields, "shards": tuple(fields["shards"])})
    out = Path(args.out)
    state_path, pace_path = out / f"rank{args.rank}.state.json", out / f"rank{args.rank}.pace"
    state = json.loads(state_path.read_text()) if state_path.exists() else None
    with open(out / f"rank{args.rank}.jsonl", "a") as history, \
            DataClient(args.addresses.split(","), config, args.rank, prefetch=2, reconnect_timeout_s=180) as client:
        if state is not None:
            client.load_state_dict(state)
        history.write(json.dumps({"event": "start", "t": time.time(),
                                  "from_step": state["next_step"] if state else 0}) + "\n")
        history.flush()
        for mb in client:
            pace = float(pace_path.read_text()) if pace_path.exists() else args.pace
            time.sleep(pace)  # the trainer's compute for this microbatch
            history.write(json.dumps({
                "t": time.time(), "rank": args.rank, "epoch": mb.epoch, "step": mb.step, "mb": mb.microbatch_index,
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
        if args.rank == 0:  # what the service reports skipped (at planning: never in a microbatch)
            history.write(json.dumps({"event": "report", "t": time.time(),
                                      "skipped": sorted({s.key for s in client.report().skipped})}) + "\n")
        history.write(json.dumps({"event": "done", "t": time.time()}) + "\n")
    return 0


# --- the cluster ---------------------------------------------------------------------------------
class Cluster:
    """Redis, replicas and relays in their namespaces; ranks are started per run."""

    def __init__(self, lab, workdir: Path, *, num_replicas: int = 3, sentinel: bool = False, log=print):
        self.lab, self.workdir, self.log = lab, workdir, log
        self.processes: list[subprocess.Popen] = []
        self.replicas: list = []
        self.sentinel = None
        try:
            self._start(num_replicas, sentinel)
        except BaseException:
            self.close()  # nothing left running in namespaces about to go
            raise

    def _start(self, num_replicas: int, sentinel: bool) -> None:
        from disttrain_tools.localcluster import LocalSentinel, Replica

        lab, workdir = self.lab, self.workdir
        workdir.mkdir(parents=True, exist_ok=True)
        redis_ip = lab.add("redis")
        self.clients_ip = lab.add("clients")
        replica_ips = [lab.add(f"rep{i}") for i in range(num_replicas)]
        relay_redis, relay_clients = lab.add("link-r0"), lab.add("link-c0")
        self.redis = self._redis_server("redis", redis_ip)
        if sentinel:  # a primary with one replica under a Sentinel; the replicas ask it where the primary is
            self._redis_server("redis2", lab.add("redis2"), "--replicaof", redis_ip, str(REDIS_PORT))
            sentinel_ip = lab.add("sentinel")
            self.sentinel = LocalSentinel(workdir / "sentinel", REDIS_PORT, port=26379, master_host=redis_ip,
                                          host=sentinel_ip, prefix=tuple(lab.exec_prefix("sentinel"))).start(30)
        python = sys.executable
        self.relays = {
            "redis": self._spawn("link-r0", [python, "-m", "disttrain_tools.impair", "--listen",
                                             f"{relay_redis}:{REDIS_PORT}", "--to", f"{redis_ip}:{REDIS_PORT}"]),
            "clients": self._spawn("link-c0", [python, "-m", "disttrain_tools.impair", "--listen",
                                               f"{relay_clients}:{SERVICE_PORT}", "--to",
                                               f"{replica_ips[0]}:{SERVICE_PORT}", "--seed", "1"]),
        }
        time.sleep(1.0)
        for i, ip in enumerate(replica_ips):
            direct = f"redis://{relay_redis if i == 0 else redis_ip}:{REDIS_PORT}/0"
            url = self.sentinel.url if self.sentinel else direct
            replica = Replica(url, port=SERVICE_PORT, host=ip, prefix=tuple(lab.exec_prefix(f"rep{i}")),
                              log_path=workdir / f"rep{i}.log", extra_args=("--lease-ttl", "2"))
            replica.start(wait=False)
            self.replicas.append(replica)
        for replica in self.replicas:
            replica.wait_ready(timeout_s=180)
        # the clients reach replica 0 through its relay, the others directly
        self.addresses = [f"{relay_clients}:{SERVICE_PORT}"] + [f"{ip}:{SERVICE_PORT}" for ip in replica_ips[1:]]

    def _redis_server(self, node: str, ip: str, *args: str) -> subprocess.Popen:
        data = self.workdir / node
        data.mkdir(parents=True, exist_ok=True)
        return self._spawn(node, ["redis-server", "--port", str(REDIS_PORT), "--bind", ip, "--protected-mode", "no",
                                  "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--dir", str(data),
                                  *args])

    def _spawn(self, node: str, command: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{node}.out", "ab")
        process = subprocess.Popen(self.lab.exec_prefix(node) + command, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=REPO)
        self.processes.append(process)
        return process

    def start_rank(self, rank: int, num_ranks: int, config: dict, out: Path, pace: float) -> subprocess.Popen:
        order = self.addresses[rank % len(self.addresses):] + self.addresses[:rank % len(self.addresses)]
        command = [sys.executable, str(REPO / "bench" / "faults.py"), "rank", "--rank", str(rank),
                   "--addresses", ",".join(order), "--config", json.dumps(config), "--out", str(out),
                   "--pace", str(pace)]
        log = open(out / f"rank{rank}.out", "ab")
        return subprocess.Popen(self.lab.exec_prefix("clients") + command, stdout=log, stderr=subprocess.STDOUT,
                                cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def close(self) -> None:
        for replica in self.replicas:
            replica.kill()
        if self.sentinel is not None:
            self.sentinel.stop()
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)


# --- faults --------------------------------------------------------------------------------------
def inject(fault: str, cluster: Cluster, ranks: dict, rng: random.Random, out: Path, pace: float):
    """Starts ``fault``; returns what heals it."""
    lab = cluster.lab
    if fault == "redis-cut":
        lab.cut("rep0", "link-r0")
        return lambda: lab.heal("rep0", "link-r0")
    if fault == "clients-cut":
        lab.cut("clients", "link-c0")
        return lambda: lab.heal("clients", "link-c0")
    if fault == "minority":
        lab.isolate("rep0")
        return lambda: lab.heal("rep0")
    if fault in ("slow-clients-link", "slow-redis-link"):
        relay = cluster.relays["clients" if fault == "slow-clients-link" else "redis"]
        relay.send_signal(signal.SIGUSR1)
        return lambda: relay.send_signal(signal.SIGUSR2)
    if fault == "redis-failover":
        lab.cut("redis", "redis2")  # replication stops; the primary goes on taking writes
        time.sleep(rng.uniform(1.0, 2.0))
        # then its machine is gone, with them (kept cut off: its kernel would still send what the
        # dead process had buffered); the Sentinel promotes a replica that never got them
        lab.isolate("redis")
        cluster.redis.kill()
        cluster.redis.wait(timeout=30)
        return lambda: lab.heal("redis")
    if fault == "rank-kill":
        victim = ranks[0]
        victim["process"].kill()
        victim["process"].wait(timeout=30)
        victim["kills"] += 1
        time.sleep(rng.uniform(0.5, 2.0))  # torchrun's restart takes a moment
        victim["process"] = victim["start"]()
        return lambda: None
    if fault == "slow-rank":
        (out / "rank1.pace").write_text(str(pace * 10))
        return lambda: (out / "rank1.pace").unlink()
    raise ValueError(f"unknown fault {fault!r}")


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
    for rank in range(num_ranks):
        acked, last_t, before, during, life = 0, None, None, set(), 0
        for line in (out / f"rank{rank}.jsonl").read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the last line of a rank SIGKILLed while writing it
                continue
            if record.get("event") == "start":
                last_t = record["t"]  # a restarted rank waits for its first microbatch from here
                life += 1  # what an earlier life got may come again; the same life gets each slot once
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
            "ranks_finished": done, "stall_s": round(max(stall, 0.0), 2), "replicas_used": len(replicas),
            "ranks_moved_during_fault": moved}


def run_fault(cluster: Cluster, fault: str, *, seed: int, shards: list[str], epochs: int, num_ranks: int,
              pace: float, duration_s: float, workdir: Path, log=print) -> dict:
    rng = random.Random(seed)
    out = workdir / f"{fault}-{seed}"
    out.mkdir(parents=True)
    config = {"shards": shards, "seq_len": 4096, "dp_size": num_ranks, "num_microbatches": 2,
              "seqs_per_microbatch": 1, "seed": seed, "num_epochs": epochs}
    ranks = {}
    for rank in range(num_ranks):
        def start(rank=rank):
            return cluster.start_rank(rank, num_ranks, config, out, pace)
        ranks[rank] = {"start": start, "process": start(), "kills": 0}
    try:
        deadline = time.monotonic() + 240
        while not all(_delivered(out, rank) >= 2 for rank in range(num_ranks)):  # every rank streaming
            if time.monotonic() > deadline or any(r["process"].poll() not in (None, 0) for r in ranks.values()):
                raise RuntimeError(f"{fault}: ranks did not start streaming (see {out})")
            time.sleep(0.1)
        time.sleep(rng.uniform(0.2, 2.0))
        fault_at = time.time()
        heal = inject(fault, cluster, ranks, rng, out, pace)
        time.sleep(duration_s)
        heal()
        healed_at = time.time()
        log(f"  {fault}: injected for {healed_at - fault_at:.1f} s, healed; waiting for the job to end")
        deadline = time.monotonic() + 300
        for rank, entry in ranks.items():
            try:
                entry["process"].wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                log(f"  {fault}: rank {rank} did not finish within 300 s of the heal (killed)")
    finally:
        for entry in ranks.values():  # none outlives its run
            if entry["process"].poll() is None:
                entry["process"].kill()
                entry["process"].wait(timeout=30)
    result = verdict(out, num_ranks, shard_keys(shards), epochs, fault_at, healed_at)
    result["fault_s"] = round(healed_at - fault_at, 1)
    job_id = JobConfig(**{**config, "shards": tuple(shards)}).job_id()
    result["lost_writes_said"] = sum(1 for replica in cluster.replicas for line in replica.log_path.read_text(
        errors="replace").splitlines() if job_id in line and "lost acknowledged writes" in line)
    return result


def _delivered(out: Path, rank: int) -> int:
    path = out / f"rank{rank}.jsonl"
    return sum(1 for line in path.read_text().splitlines() if '"step"' in line) if path.exists() else 0


def faults(*, names: list[str], runs: int, shards: list[str], epochs: int, num_ranks: int, pace: float,
           duration_s: tuple[float, float], slow_rank_s: float, short_s: float = 1e9, seed: int = 0,
           log=print) -> dict:
    from disttrain_tools import netlab

    rng = random.Random(seed)
    workdir = Path(tempfile.mkdtemp(prefix="disttrain-faults-"))
    results: dict[str, list[dict]] = {name: [] for name in names}

    def one(cluster: Cluster, name: str, run: int) -> None:
        seconds = slow_rank_s if name == "slow-rank" else rng.uniform(*duration_s)
        if name in SHORT:
            seconds = min(seconds, short_s)
        result = run_fault(cluster, name, seed=seed * 1000 + run * 100 + list(FAULTS).index(name), shards=shards,
                           epochs=epochs, num_ranks=num_ranks, pace=pace, duration_s=seconds, workdir=workdir,
                           log=log)
        log(f"  {name} run {run + 1}: " + ", ".join(f"{k} {v}" for k, v in result.items()))
        results[name].append(result)

    shared = [name for name in names if name != "redis-failover"]
    if shared:
        with netlab.NetLab() as lab:
            cluster = Cluster(lab, workdir / "cluster", log=log)
            try:
                for run in range(runs):
                    for name in rng.sample(shared, len(shared)):  # a random order each round
                        one(cluster, name, run)
            finally:
                cluster.close()
    for run in range(runs if "redis-failover" in names else 0):  # a fresh primary and replica each time
        with netlab.NetLab() as lab:
            cluster = Cluster(lab, workdir / f"sentinel-{run}", sentinel=True, log=log)
            try:
                one(cluster, "redis-failover", run)
            finally:
                cluster.close()
    return {"workdir": str(workdir), "results": results}


def summary(results: dict[str, list[dict]]) -> list[list]:
    rows = []
    for name, runs in results.items():
        stalls = [r["stall_s"] for r in runs]
        rows.append([name, len(runs), sum(r["keys_lost"] for r in runs), sum(r["keys_repeated"] for r in runs),
                     sum(r["conflicting_microbatches"] for r in runs),
                     sum(r["acknowledged_steps_replayed"] for r in runs),
                     round(statistics.median(stalls), 2) if stalls else None, max(stalls, default=None),
                     sum(r.get("lost_writes_said", 0) for r in runs), PROMISES[name]])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    rank = sub.add_parser("rank", help="(internal) one client rank")
    rank.add_argument("--rank", type=int, required=True)
    rank.add_argument("--addresses", required=True)
    rank.add_argument("--config", required=True)
    rank.add_argument("--out", required=True)
    rank.add_argument("--pace", type=float, default=0.2)
    parser.add_argument("--faults", nargs="+", choices=list(FAULTS), default=list(FAULTS))
    parser.add_argument("--runs", type=int, default=3, help="runs of each fault, in a random order each round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="one run of each fault, a few seconds each, small data")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.command == "rank":
        return rank_main(args)

    from disttrain_tools import netlab

    reason = netlab.unavailable()
    if reason is not None:
        print(f"faults: skipped: {reason}")
        return 0
    if args.quick:
        runs, shards, epochs, pace, duration, slow_rank_s = 1, benchjson.quick_shards(2, 40), 6, 0.12, (10.0, 10.0), 4.0
        short_s = 4.0
    else:
        shards = benchjson.quick_shards(4, 50)
        runs, epochs, pace, duration, slow_rank_s, short_s = args.runs, 16, 0.1, (8.0, 15.0), 60.0, 1e9
    print(f"faults: {', '.join(args.faults)}; {runs} run(s) each, {epochs} epochs of {len(shard_keys(shards))} "
          f"samples, 3 replicas, 2 ranks")
    figures = faults(names=args.faults, runs=runs, shards=shards, epochs=epochs, num_ranks=2, pace=pace,
                     duration_s=duration, slow_rank_s=slow_rank_s, short_s=short_s, seed=args.seed)
    rows = summary(figures["results"])
    header = ["fault", "runs", "keys lost", "keys repeated", "conflicting microbatches", "acked steps replayed",
              "stall s (median)", "stall s (worst)", "lost writes said", "promise"]
    print("  " + " | ".join(header[:-1]))
    for row in rows:
        print("  " + " | ".join(str(v) for v in row[:-1]))
    doc = benchjson.document("faults", quick=args.quick) | {"results": figures["results"]}
    doc["tables"].append(benchjson.table(
        "faults: 3 replicas on one Redis, 2 ranks, each fault injected at a random time and healed",
        header, rows, notes=[f"{name}: {text}" for name, text in FAULTS.items() if name in args.faults]
        + ["stall: the longest wait of any rank for a microbatch beyond its own pace, from the fault until 30 s "
           "after the heal", "verdict from the ranks' histories and the shards read with tarfile"]))
    benchjson.write(args.json, doc)
    bad = any(row[2] or row[3] or row[4] or row[5] for row in rows)
    unfinished = [name for name, runs_ in figures["results"].items() for r in runs_ if r["ranks_finished"] < 2]
    if unfinished:
        print(f"faults: ranks did not finish in {unfinished}")
    return 1 if bad or unfinished else 0


if __name__ == "__main__":
    sys.exit(main())
