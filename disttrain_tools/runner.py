"""The main job: one epoch from shards through the service to N trainer-client ranks, measured.

Each rank is a separate process running trainer.DataClient, as a trainer worker would. The
service is embedded (started in this process on a free loopback port) unless an address is
given. At the end it prints throughput, the data-parallel balance with and without reordering,
and the exactly-once check: every key in the shards was delivered once, or skipped with a reason,
or delivered once while a dropped duplicate of it was reported (RunResult.exactly_once).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from disttrain_api import preprocess_pb2 as pb
from disttrain_api import preprocess_pb2_grpc as pb_grpc
from disttrain_api.channel import CHANNEL_OPTIONS
from disttrain_api.config import JobConfig
from disttrain_api.errors import SampleError, ServiceUnavailableError
from disttrain_api.spec import spec_from_config
from disttrain_tools.rank_client import RankResult, consume_rank
from preprocess_service.adapters.io import shards
from preprocess_service.service.server import DEFAULTS, create_server
from preprocess_service.service.settings import ServiceSettings

__all__ = ["KEPT_FIRST_COPY_KINDS", "RankResult", "RunResult", "all_keys", "consume_rank", "run_job", "summary",
           "write_report"]

KEPT_FIRST_COPY_KINDS = ("duplicate_key", "duplicate_member")
"""Skip kinds that report a dropped copy while the first copy with the same key is kept (tarstream.py,
planner.py): their key may also be delivered, once."""
assert set(KEPT_FIRST_COPY_KINDS) <= set(SampleError.NOT_LOST)

_FATES = ("delivered_once", "skipped", "kept_first_copy", "duplicated", "delivered_and_skipped", "missing",
          "unexpected")
_FAILED = ("duplicated", "delivered_and_skipped", "missing", "unexpected")


def _fate(times: int, passes: int, *, lost: bool, copy: bool, known: bool) -> str:
    """Which of _FATES a key had: delivered ``times`` times in ``passes`` passes over the shards,
    reported lost (in one pass or more), reported as a dropped copy, ``known`` from the shards or a
    skip record."""
    if not known:
        return "unexpected"
    if times > passes:
        return "duplicated"
    if times == passes:
        return "delivered_and_skipped" if lost else "kept_first_copy" if copy else "delivered_once"
    return "skipped" if lost else "missing"


@dataclass(slots=True)
class RunResult:
    job_id: str
    ranks: list[RankResult]
    skipped: list[dict]
    step_balance: list[dict]
    shard_keys: set[str]
    seconds: float
    datasets: list[dict] = field(default_factory=list)
    """JobReport.datasets of a mixture: name, num_samples (planned), restarts, weight; empty for plain shards."""
    num_epochs: int = 1
    """Passes over the shards: each key is delivered this many times (JobConfig.num_epochs)."""

    @property
    def received(self) -> Counter:
        return Counter(key for rank in self.ranks for key in rank.keys)

    def exactly_once(self) -> dict:
        """The exactly-once check of plain shards, per key (a mixture is checked against what the
        planner drew from each dataset instead: ``mixture_check``). Every key of the shards, and
        every key a skip record names, must be exactly one of:

        - delivered once (once per pass: ``num_epochs``), and not reported;
        - reported with a reason (``skipped``), and not delivered (in the passes it was lost in);
        - delivered once and reported as a dropped copy (``kept_first_copy``: a duplicate member
          or key whose first copy was kept and delivered; KEPT_FIRST_COPY_KINDS).

        Failures: a key delivered more often than that (``duplicated``), delivered and also reported
        lost (``delivered_and_skipped``), neither delivered nor reported lost (``missing``: a key
        reported only as a dropped copy is missing, its first copy went nowhere), delivered but not
        in the shards (``unexpected``), a rank that failed, or nothing delivered at all. A record
        without a key (a whole shard: unreadable side files, a shard cut before its first sample)
        is not a key and counts in none of these."""
        if self.datasets:
            return self.mixture_check()
        received = self.received
        lost = {s["key"] for s in self.skipped if s["key"] and s["kind"] not in KEPT_FIRST_COPY_KINDS}
        copies = {s["key"] for s in self.skipped if s["key"] and s["kind"] in KEPT_FIRST_COPY_KINDS}
        keys = self.shard_keys | lost | copies
        fates: dict[str, list[str]] = {fate: [] for fate in _FATES}
        for key in sorted(keys | set(received)):
            fates[_fate(received[key], self.num_epochs, lost=key in lost, copy=key in copies,
                        known=key in keys)].append(key)
        nothing = not received
        ok = not (nothing or any(fates[f] for f in _FAILED) or any(r.error for r in self.ranks))
        return {"ok": ok, "num_keys": len(keys), "passes": self.num_epochs, "delivered": len(received),
                "delivered_once": len(fates["delivered_once"]), "skipped": len(fates["skipped"]),
                "kept_first_copy": fates["kept_first_copy"], "duplicated": fates["duplicated"],
                "missing": fates["missing"], "unexpected": fates["unexpected"],
                "delivered_and_skipped": fates["delivered_and_skipped"], "nothing_delivered": nothing}

    def mixture_check(self) -> dict:
        """Per dataset: every sample the planner drew was delivered (or skipped at decode with a
        reason), none more often than the dataset's passes, and only keys its shards hold. Where
        the planner's counts are unknown (another replica plans), only the last holds."""
        received = self.received
        skipped_at_decode = {s["key"] for s in self.skipped if s["kind"] in ("decode_failed", "decode_worker_died")}
        per_dataset = Counter(key.split("/", 1)[0] for key in received.elements())
        problems, over = [], []
        for d in self.datasets:
            if d["num_samples"] is None:
                continue
            got = per_dataset.get(d["name"], 0)
            if got > d["num_samples"] or got < d["num_samples"] - len(skipped_at_decode):
                problems.append(f"{d['name']}: {got} delivered, {d['num_samples']} planned")
            over += sorted(k for k, n in received.items() if k.startswith(d["name"] + "/") and n > 1 + d["restarts"])
        unexpected = sorted(k for k in received if k.split("/", 1)[1] not in self.shard_keys)
        nothing = not received
        ok = not (nothing or problems or over or unexpected or any(r.error for r in self.ranks))
        return {"ok": ok, "num_keys": len(self.shard_keys), "passes": 1, "delivered": sum(received.values()),
                "delivered_once": len(received), "skipped": len(skipped_at_decode), "kept_first_copy": [],
                "duplicated": over, "missing": problems, "unexpected": unexpected, "delivered_and_skipped": [],
                "nothing_delivered": nothing}


def run_job(config: JobConfig, *, address: str | None = None, prefetch: int = 4,
            progress: bool = True, connect_timeout_s: float = 10.0, decode_workers: int | None = None,
            settings: ServiceSettings = DEFAULTS) -> RunResult:
    """Runs one pass over the job with ``config.dp_size`` client processes; the embedded service
    (no ``address``) gets ``decode_workers`` decode processes (default one per core) and ``settings``."""
    server = None
    if address is None:
        server, port, _ = create_server("127.0.0.1:0", settings, decode_workers=decode_workers)
        address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = pb_grpc.PreprocessStub(channel)
    try:
        try:
            grpc.channel_ready_future(channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            raise ServiceUnavailableError(f"cannot reach the preprocessing service at {address!r} within "
                                          f"{connect_timeout_s:g} s "
                                          "(is it running, and is the address right?)") from None
        info = stub.OpenJob(pb.OpenJobRequest(spec=spec_from_config(config)), timeout=60)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        start = time.perf_counter()
        procs = [ctx.Process(target=consume_rank, args=(address, info.job_id, r, prefetch, results), daemon=True)
                 for r in range(config.dp_size)]
        for proc in procs:
            proc.start()
        ranks = _collect(procs, results, stub, info.job_id, progress)
        seconds = time.perf_counter() - start
        report = stub.GetReport(pb.ReportRequest(job_id=info.job_id))
    finally:
        channel.close()
        if server is not None:
            server.stop(grace=1).wait()
    return RunResult(
        job_id=info.job_id, ranks=sorted(ranks, key=lambda r: r.rank),
        skipped=[{"key": s.key, "shard": s.shard, "reason": s.reason, "kind": s.kind} for s in report.skipped],
        step_balance=[{"step": b.step, "imbalance": b.imbalance, "arrival_imbalance": b.arrival_imbalance,
                       "rank_load_s": list(b.rank_load_s), "num_sequences": b.num_sequences,
                       "num_samples": b.num_samples, "iteration_s": b.iteration_s,
                       "arrival_iteration_s": b.arrival_iteration_s, "lower_bound_s": b.lower_bound_s}
                      for b in report.step_balance],
        shard_keys=all_keys(_listed(info)), seconds=seconds,
        datasets=_dataset_rows(info, report), num_epochs=config.num_epochs)


def _listed(info: pb.JobInfo) -> list[str]:
    """Every shard of the job, which the exactly-once check reads the keys of."""
    if info.num_shards > len(info.shard_urls):
        raise SystemExit(f"run's exactly-once check reads every shard's keys; this job has {info.num_shards} "
                         f"shards, more than the service lists ({len(info.shard_urls)}): train with DataClient instead")
    return list(info.shard_urls)


def _dataset_rows(info: pb.JobInfo, report: pb.JobReport) -> list[dict]:
    """Per dataset of a mixture: its weight and what the planner drew (None where the replica that
    answered does not plan the job: with Redis, only the planning replica counts)."""
    counts = {d.name: d for d in report.datasets}
    rows = []
    for spec in info.spec.datasets:
        count = counts.get(spec.name)
        rows.append({"name": spec.name, "weight": spec.weight,
                     "num_samples": count.num_samples if count else None,
                     "num_tokens": count.num_tokens if count else None,
                     "restarts": count.restarts if count else None})
    return rows


def _collect(procs, results, stub, job_id: str, progress: bool) -> list[RankResult]:
    ranks: list[RankResult] = []
    last_line, last_print = "", 0.0
    while len(ranks) < len(procs):
        try:
            ranks.append(results.get(timeout=1.0))
            continue
        except queue.Empty:  # time for a progress line and a liveness check
            pass
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"client process {dead[0].name} died with exit code {dead[0].exitcode}")
        if progress and time.perf_counter() - last_print >= 2.0:
            line = _progress_line(stub.GetReport(pb.ReportRequest(job_id=job_id)))
            if line != last_line:
                print(line, file=sys.stderr, flush=True)
                last_line, last_print = line, time.perf_counter()
    for proc in procs:
        proc.join(timeout=10)
    return ranks


def _progress_line(report: pb.JobReport) -> str:
    """Service-side totals of the job (they include earlier runs against the same service)."""
    planned = (f"all {report.num_planned_steps} steps planned" if report.planning_done
               else f"{report.num_planned_steps} steps planned so far (total known once the shards are read)")
    return (f"[run] {report.num_sent_microbatches} microbatches sent; {planned}; "
            f"{report.num_planned_samples} samples planned, {len(report.skipped)} skipped")


def all_keys(urls: list[str]) -> set[str]:
    """Every sample key in the shards, read straight from the tars (independent of the planner)."""
    keys: set[str] = set()
    for url in urls:
        keys.update(s["__key__"] for s in shards.iter_shard(url, lambda problem: None))
    return keys


def summary(result: RunResult, config: JobConfig) -> str:
    """The human-readable result table."""
    seconds = max(result.seconds, 1e-9)
    num_samples = sum(len(r.keys) for r in result.ranks)
    num_sequences = sum(r.num_sequences for r in result.ranks)
    num_bytes = sum(r.num_bytes for r in result.ranks)
    check = result.exactly_once()
    balance = result.step_balance
    # The short last step of an epoch says little about balancing; average over full steps.
    full = [b for b in balance if b["num_sequences"] == config.global_batch] or balance
    reasons = Counter(s["kind"] for s in result.skipped)
    lines = [
        f"job {result.job_id}: dp_size={config.dp_size} microbatches={config.num_microbatches} "
        f"seqs/microbatch={config.seqs_per_microbatch} seq_len={config.seq_len} "
        f"reorder={config.reorder_algorithm} stages={','.join(config.stage_map)}"
        + (f" shared_by=enc:{config.enc_shared_by},gen:{config.gen_shared_by}"
           if (config.enc_shared_by, config.gen_shared_by) != (1, 1) else ""),
        f"  wall time            {seconds:8.2f} s  (client processes, start to last microbatch)",
        f"  samples              {num_samples:8d}   {num_samples / seconds:9.1f} samples/s",
        f"  packed sequences     {num_sequences:8d}   {num_sequences / seconds:9.1f} sequences/s",
        f"  payload              {num_bytes / 1e6:8.1f} MB {num_bytes / 1e6 / seconds:9.1f} MB/s",
        f"  steps                {len(balance):8d}",
        "  data wait per rank   " + ", ".join(f"{r.data_wait_s:.2f} s" for r in result.ranks)
        + "  (DataClient.data_wait_s; a consumer that trains nothing waits for every microbatch)",
    ]
    if full:
        arrival = float(np.mean([b["arrival_imbalance"] for b in full]))
        planned = float(np.mean([b["imbalance"] for b in full]))
        lines.append(f"  DP imbalance (max/mean rank load, mean over {len(full)} full steps): "
                     f"no reordering {arrival:.3f} -> reordered {planned:.3f}")
        sim = {k: float(np.sum([b[k] for b in full])) for k in ("arrival_iteration_s", "iteration_s", "lower_bound_s")}
        lines.append(f"  simulated 1F1B time (cost model, sum over the same steps): no reordering "
                     f"{sim['arrival_iteration_s']:.3f} s -> reordered {sim['iteration_s']:.3f} s; "
                     f"lower bound {sim['lower_bound_s']:.3f} s")
    causes = ", ".join(f"{n} x {reason}" for reason, n in reasons.most_common())
    lines.append(f"  skipped              {len(result.skipped):8d}" + (f"   {causes}" if causes else ""))
    lines.append(exactly_once_line(check))
    lines.extend(mixture_lines(result))
    for rank in result.ranks:
        if rank.error:
            lines.append(f"  rank {rank.rank} failed: {rank.error}")
    return "\n".join(lines)


def exactly_once_line(check: dict) -> str:
    """The exactly-once check in one line: how many keys had each fate, and why it failed."""
    once = "delivered once" if check["passes"] == 1 else f"delivered once in each of {check['passes']} passes"
    counts = [f"{check['delivered_once']} {once}", f"{check['skipped']} skipped with reasons",
              f"{len(check['kept_first_copy'])} delivered + reported duplicate",
              f"{len(check['missing'])} missing", f"{len(check['duplicated'])} duplicated"]
    counts += [f"{len(check[name])} {label}" for name, label in
               (("delivered_and_skipped", "delivered and reported lost"), ("unexpected", "not in the shards"))
               if check[name]]
    line = f"  exactly-once: {'OK' if check['ok'] else 'FAILED'} ({', '.join(counts)}, of {check['num_keys']} keys)"
    return line + ("; nothing was delivered" if check["nothing_delivered"] else "")


def delivered_per_dataset(result: RunResult) -> Counter:
    """Samples delivered per dataset name of a mixture (keys are "DATASET/KEY")."""
    return Counter(key.split("/", 1)[0] for key in result.received.elements())


def mixture_lines(result: RunResult) -> list[str]:
    """Per dataset of a mixture: samples delivered, their share against the requested weight."""
    if not result.datasets:
        return []
    delivered = delivered_per_dataset(result)
    total_samples = max(1, sum(delivered.values()))
    total_tokens = max(1, sum(d["num_tokens"] or 0 for d in result.datasets))
    total_weight = sum(d["weight"] for d in result.datasets)
    lines = ["  mixture              dataset: samples delivered, share of samples (of tokens) vs weight"]
    for d in result.datasets:
        n = delivered.get(d["name"], 0)
        restarted = f", restarted {d['restarts']}x" if d["restarts"] else ""
        tokens = f"({(d['num_tokens'] or 0) / total_tokens:6.1%})" if d["num_tokens"] is not None else "(  n/a )"
        lines.append(f"    {d['name']:<20} {n:8d}   {n / total_samples:6.1%} {tokens} "
                     f"vs {d['weight'] / total_weight:6.1%}{restarted}")
    return lines


def write_report(path: Path, result: RunResult, config: JobConfig) -> None:
    """JSON report: per rank the microbatches received in order (step, microbatch, keys), the keys
    skipped with cause and reason, per-step balance, and the exactly-once check."""
    report = {
        "format": "disttrain-run-report/1",
        "job_id": result.job_id,
        "config": config.to_dict(),
        "seconds": result.seconds,
        "ranks": {str(r.rank): {"microbatches": r.microbatches, "error": r.error, "data_wait_s": r.data_wait_s}
                  for r in result.ranks},
        "skipped": result.skipped,
        "step_balance": result.step_balance,
        "exactly_once": result.exactly_once(),
        "datasets": [{**d, "delivered": delivered_per_dataset(result).get(d["name"], 0)} for d in result.datasets],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
