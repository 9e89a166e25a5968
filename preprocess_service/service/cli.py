"""Command line: ``python -m preprocess_service {run,serve,synth}``.

run    one epoch through the service to dp_size client ranks, with measurements and the
       exactly-once check (default: a synthetic LAION-style dataset, embedded service)
serve  the service alone on a port, until SIGINT/SIGTERM (settings: flags, DISTTRAIN_* or a TOML file)
status a running job's progress: steps planned and sent, balance, skipped samples
health exit 0 if the service at --address answers SERVING (container health checks)
synth  write synthetic LAION-style shards
reorder  plan or evaluate a batch-planning instance (JSON)
calibrate  fit the cost model from timings of torch modules; prints the fit and its error
inspect  what to check before a run: modalities, sizes, sequence costs, predicted stragglers (text and PNG)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import grpc

from disttrain_api.cli_args import add_job_arguments, job_fields
from disttrain_api.config import JobConfig
from disttrain_api.errors import ConfigError, DisttrainError

DEMO_DIR = Path("data/laion-demo")


def _add_job_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", nargs="+", metavar="SPEC",
                        help="shard paths/URLs, brace patterns allowed (\"data/{00000..00009}.tar\"), or a "
                             f"directory of tars (default: a synthetic LAION-style set in {DEMO_DIR}/)")
    parser.add_argument("--mix", type=Path, metavar="FILE",
                        help="a weighted mixture of datasets instead of --shards: a YAML or JSON file of "
                             "datasets (name, shards, weight, optional modalities, image, generate) and "
                             "optionally mix_by, mix_epoch, mix_epoch_samples, which win over the flags "
                             "(see disttrain_api/mixture.py)")
    add_job_arguments(parser)
    parser.add_argument("--cost", type=Path, help="cost coefficients JSON, as `calibrate --out` writes")


def _job_config(args) -> JobConfig:
    extra: dict = {}
    if getattr(args, "mix", None):
        from disttrain_api.mixture import load_mixture

        if args.shards:
            raise ConfigError("give --shards or --mix, not both")
        extra.update(load_mixture(args.mix))
        shard_specs: list[str] = []
    else:
        shard_specs = args.shards or [str(p) for p in ensure_demo_dataset()]
    if args.cost:
        from preprocess_service.adapters import calibrate

        try:
            extra["cost"] = calibrate.load(args.cost)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"--cost {args.cost}: {exc}") from None
    return JobConfig(shards=tuple(shard_specs), **{**job_fields(args), **extra})


def ensure_demo_dataset(out_dir: Path = DEMO_DIR) -> list[Path]:
    """The embedded default: 4 synthetic LAION-style shards plus one with corrupt samples."""
    from preprocess_service.adapters import synth

    marker = out_dir / synth.MARKER_NAME
    before = marker.read_text() if marker.exists() else None
    paths = synth.ensure_dataset(out_dir, synth.SynthConfig())
    corrupt = out_dir / "corrupt.tar"
    if not corrupt.exists() or marker.read_text() != before:  # regenerated: the corrupt shard too
        synth.write_corrupt_shard(corrupt)
    return [*paths, corrupt]


def cmd_run(args) -> int:
    if not args.address and args.decode_workers != 0:  # embedded service: its slowest start first
        from preprocess_service.adapters import forkserver

        forkserver.start()
    from preprocess_service.service.runner import run_job, summary, write_report

    config = _job_config(args)
    what = f"{len(config.datasets)} datasets" if config.datasets else f"{len(config.shards)} shard spec(s)"
    print(f"[run] {what}; service "
          f"{'at ' + args.address if args.address else 'embedded'}; {config.dp_size} client ranks",
          file=sys.stderr, flush=True)
    from preprocess_service.service.server import Limits

    limits = Limits(allowed_shard_schemes=tuple(s.strip() for s in args.allowed_shard_schemes.split(",")
                                                if s.strip())) \
        if args.allowed_shard_schemes else Limits()
    result = run_job(config, address=args.address, prefetch=args.prefetch, connect_timeout_s=args.connect_timeout,
                     decode_workers=args.decode_workers, limits=limits)
    print(summary(result, config))
    if args.report:
        write_report(args.report, result, config)
        print(f"report written to {args.report}")
    return 0 if result.exactly_once()["ok"] else 1


def cmd_serve(args) -> int:
    from preprocess_service.service import settings

    cfg = settings.from_args(args)
    if cfg.decode_workers != 0:  # the decode workers' fork server imports torch while this process imports the rest
        from preprocess_service.adapters import forkserver

        forkserver.start()
    from preprocess_service.adapters import metrics
    from preprocess_service.adapters.store import describe
    from preprocess_service.service import logs
    from preprocess_service.service.security import TlsFiles
    from preprocess_service.service.server import Limits, create_server

    logs.configure(cfg.log_format, cfg.log_level)
    tls = TlsFiles(Path(cfg.tls_cert), Path(cfg.tls_key), Path(cfg.tls_client_ca) if cfg.tls_client_ca else None) \
        if cfg.tls_cert else None
    limits = Limits(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(Limits)})  # same names
    server, port, _ = create_server(f"{cfg.host}:{cfg.port}", prefetch=cfg.prefetch, max_workers=cfg.max_workers,
                                    decode_workers=cfg.decode_workers, redis_url=cfg.redis_url,
                                    replica_id=cfg.replica_id, job_options={"lease_ttl_s": cfg.lease_ttl_s},
                                    tls=tls, auth_tokens=cfg.tokens(), limits=limits, state_dir=cfg.state_dir)
    metrics_port = 0
    if cfg.metrics_port:
        _, _, metrics_port = metrics.serve(cfg.metrics_port, cfg.metrics_host, cfg.metrics_tokens())
    mode = f"replica of the deployment on Redis {describe(cfg.redis_url)}" if cfg.redis_url else "single node, no Redis"
    security = ", ".join(filter(None, ["mutual TLS" if cfg.tls_client_ca else "TLS" if tls else "plaintext",
                                       "token auth" if cfg.tokens() else "no auth"]))
    print(f"disttrain preprocessing service listening on {cfg.host}:{port}", flush=True)
    print(f"mode: {mode}; {security}; metrics: "
          f"{f'http://{cfg.metrics_host}:{metrics_port}/metrics' if metrics_port else 'off'}"
          f"{' (token required)' if cfg.metrics_tokens() else ''}", flush=True)
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    # Drain: new calls are refused, open ones get shutdown_grace_s, then everything is cut. A call
    # stuck on an untrusted peer must not keep the process alive: after the bound it exits anyway.
    print(f"stopping: draining for up to {cfg.shutdown_grace_s:g} s", flush=True)
    drained = server.stop(grace=cfg.shutdown_grace_s).wait(cfg.shutdown_grace_s + 5)
    print("stopped" if drained else "stopped (some calls did not end in time)", flush=True)
    logging.shutdown()
    os._exit(0)


def cmd_status(args) -> int:
    """Prints a job's progress from GetReport, once or every --watch seconds."""
    import time

    from disttrain_api import preprocess_pb2 as pb
    from disttrain_api import preprocess_pb2_grpc as pb_grpc
    from disttrain_api.channel import Credentials

    with Credentials.from_env().channel(args.address) as channel:
        stub = pb_grpc.PreprocessStub(channel)
        while True:
            info = stub.DescribeJob(pb.DescribeJobRequest(job_id=args.job_id), timeout=args.timeout)
            report = stub.GetReport(pb.ReportRequest(job_id=args.job_id), timeout=args.timeout)
            print(_status_text(info, report), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.watch)


def cmd_health(args) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from disttrain_api.channel import Credentials

    with Credentials.from_env().channel(args.address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"not serving: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _status_text(info, report) -> str:
    from collections import Counter

    total = f"of {info.num_steps}" if report.planning_done else "(planning goes on)"
    sent_steps = report.num_sent_microbatches / max(1, info.spec.dp_size * info.spec.num_microbatches)
    lines = [f"job {info.job_id}: {info.spec.dp_size} ranks x {info.spec.num_microbatches} microbatches x "
             f"{info.spec.seqs_per_microbatch} sequences of {info.spec.seq_len} tokens, {len(info.shard_urls)} shards",
             f"  planned  {report.num_planned_steps} steps {total}, {report.num_planned_samples} samples",
             f"  sent     {report.num_sent_microbatches} microbatches (~{sent_steps:.1f} steps)",
             f"  skipped  {len(report.skipped)} samples"
             + (": " + ", ".join(f"{n} x {k}" for k, n in Counter(s.kind for s in report.skipped).most_common())
                if report.skipped else "")]
    if report.step_balance:
        last = report.step_balance[-1]
        lines.append(f"  step {last.step}: imbalance {last.imbalance:.3f} "
                     f"(arrival order {last.arrival_imbalance:.3f}), "
                     f"simulated {last.iteration_s:.3f} s vs {last.arrival_iteration_s:.3f} s unordered, "
                     f"bound {last.lower_bound_s:.3f} s")
    return "\n".join(lines)


def cmd_calibrate(args) -> int:
    from preprocess_service.adapters import calibrate

    config, _ = calibrate.calibrate(quick=args.quick)
    if args.out:
        calibrate.save(config, args.out)
        print(f"coefficients written to {args.out} (use: run --cost {args.out})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m preprocess_service", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="one epoch through the service to client ranks, measured")
    _add_job_args(run)
    run.add_argument("--address", help="use a running service at HOST:PORT instead of an embedded one")
    run.add_argument("--prefetch", type=int, default=4, help="microbatches each client reads ahead")
    run.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to wait for --address")
    run.add_argument("--report", type=Path, help="write a JSON report (keys per rank, skipped keys) here")
    run.add_argument("--decode-workers", type=int, default=None,
                     help="decode processes of the embedded service (default: one per core; 0: threads in-process)")
    run.add_argument("--allowed-shard-schemes", default=None, metavar="SCHEMES",
                     help="the embedded service's allowed shard schemes, comma-separated (default file,http,https; "
                          "add pipe to read pipe:COMMAND shards: you are the operator here)")
    serve = sub.add_parser("serve", help="run the service alone")
    from preprocess_service.service import settings

    settings.add_arguments(serve)
    status = sub.add_parser("status", help="a running job's progress")
    status.add_argument("--address", default=os.environ.get("DISTTRAIN_ADDRESS", "127.0.0.1:50051"),
                        help="service address ($DISTTRAIN_ADDRESS; TLS and token from DISTTRAIN_TLS_* / "
                             "DISTTRAIN_AUTH_TOKEN)")
    status.add_argument("--job-id", required=True)
    status.add_argument("--watch", type=float, default=0, metavar="SECONDS", help="print again every SECONDS")
    status.add_argument("--timeout", type=float, default=10.0)
    health = sub.add_parser("health", help="exit 0 if the service answers SERVING")
    health.add_argument("--address", default=f"127.0.0.1:{os.environ.get('DISTTRAIN_PORT', '50051')}")
    health.add_argument("--timeout", type=float, default=3.0)
    sub.add_parser("synth", help="write synthetic LAION-style shards (see --help)", add_help=False)
    sub.add_parser("reorder", help="plan or evaluate one batch-planning instance JSON (see --help)", add_help=False)
    sub.add_parser("inspect", help="statistics of a job's data and predicted stragglers (see --help)", add_help=False)
    cal = sub.add_parser("calibrate", help="fit the cost model from timings of torch modules")
    cal.add_argument("--out", type=Path, help="write the fitted coefficients here (JSON for run --cost)")
    cal.add_argument("--quick", action="store_true", help="fewer sizes and repeats (seconds)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "synth":
        from preprocess_service.adapters import synth

        return synth.main(rest)
    if args.command == "reorder":
        from preprocess_service.service import reorder_cli

        return reorder_cli.main(rest)
    if args.command == "inspect":
        from preprocess_service.service import inspect_cli

        return inspect_cli.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return {"run": cmd_run, "serve": cmd_serve, "calibrate": cmd_calibrate, "status": cmd_status,
                "health": cmd_health}.get(args.command or "run", cmd_run)(
            args if args.command else parser.parse_args(["run"]))
    except (ConfigError, DisttrainError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        if exc.code() not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                              grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED,
                              grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED):
            raise
        print(f"error: {exc.details()}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
