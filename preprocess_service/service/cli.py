"""The service's own command line: ``python -m preprocess_service {serve,status,health}`` (what the
service image runs). The tools (run, synth, reorder, inspect, calibrate) are ``python -m
disttrain_tools`` (the ``disttrain`` command), which also offers these three.

serve  the service alone on a port, until SIGINT/SIGTERM (settings: flags, DISTTRAIN_* or a TOML file)
status a running job's progress: steps planned and sent, balance, skipped samples
health exit 0 if the service at --address answers SERVING (container health checks)
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import grpc

from disttrain_api.errors import ConfigError, DisttrainError

TOOLS = ("run", "synth", "reorder", "inspect", "calibrate")
"""Commands of the tools' CLI (python -m disttrain_tools), named here to point there."""


def cmd_serve(args) -> int:
    from preprocess_service.service import settings

    cfg = settings.from_args(args)
    from preprocess_service.service.front import Front
    from preprocess_service.service.security import TlsFiles

    tls = TlsFiles(Path(cfg.tls_cert), Path(cfg.tls_key), Path(cfg.tls_client_ca) if cfg.tls_client_ca else None) \
        if cfg.tls_cert else None
    # the port first, answering health (NOT_SERVING until the service is attached): a fraction of
    # a second after launch, where the imports below take seconds (front.py)
    front = Front(f"{cfg.host}:{cfg.port}", max_workers=cfg.max_workers, max_request_bytes=cfg.max_request_bytes,
                  tokens=cfg.tokens(), tls=tls)
    if cfg.decode_workers != 0:  # the decode workers' fork server imports torch while this process imports the rest
        from preprocess_service.adapters.decode import forkserver

        forkserver.start()
    from preprocess_service.adapters.infra import metrics
    from preprocess_service.adapters.infra.store import describe
    from preprocess_service.service import logs
    from preprocess_service.service.server import create_server

    logs.configure(cfg.log_format, cfg.log_level)
    try:
        server, port, _ = create_server(f"{cfg.host}:{cfg.port}", cfg, tls=tls, front=front)
    except BaseException:
        front.server.stop(0)
        raise
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
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack on stderr
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    # woken now and then: Python runs a signal's handler in the main thread, and a signal the
    # kernel hands to another thread (gRPC's) does not interrupt a wait without a timeout
    while not stopped.wait(0.5):
        pass
    # Drain: new calls are refused, open ones get shutdown_grace_s, then everything is cut. A call
    # stuck on an untrusted peer must not keep the process alive: after the bound it exits anyway.
    print(f"stopping: draining for up to {cfg.shutdown_grace_s:g} s", flush=True)
    drained = server.stop(grace=cfg.shutdown_grace_s).wait(cfg.shutdown_grace_s + 5)
    print("stopped" if drained else "stopped (some calls did not end in time)", flush=True)
    logging.shutdown()
    os._exit(0)


def cmd_status(args) -> int:
    """Prints every open job's progress (ListJobs), or one job's (GetReport), once or every --watch seconds."""
    import time

    from disttrain_api import preprocess_pb2 as pb
    from disttrain_api import preprocess_pb2_grpc as pb_grpc
    from disttrain_api.channel import Credentials

    with Credentials.from_env().channel(args.address) as channel:
        stub = pb_grpc.PreprocessStub(channel)
        while True:
            if not args.job_id:
                print(_jobs_text(stub.ListJobs(pb.ListJobsRequest(), timeout=args.timeout).jobs), flush=True)
                if not args.watch:
                    return 0
                time.sleep(args.watch)
                continue
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
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        from preprocess_service.service.front import WARM_SERVICE

        with Credentials.from_env().channel(args.address) as channel:
            try:
                warm = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=WARM_SERVICE),
                                                                timeout=args.timeout)
                if warm.status != health_pb2.HealthCheckResponse.SERVING:
                    status += " (warming: the planner's kernels or the decode workers are still starting)"
            except grpc.RpcError:  # an older server: no warm entry
                pass
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_warm(args) -> int:
    """Compiles every planner kernel signature into numba's cache; prints where and how long."""
    import time

    from preprocess_service.core.reorder.instance import warm_kernels

    began = time.perf_counter()
    runs = warm_kernels()
    print(f"compiled the planner's kernels ({runs} planner runs) in {time.perf_counter() - began:.1f} s "
          f"into {os.environ.get('NUMBA_CACHE_DIR') or 'the package __pycache__'}")
    return 0


def _jobs_text(jobs) -> str:
    """A table of ListJobs' summaries."""
    if not jobs:
        return "no open jobs"
    lines = [f"{len(jobs)} open job(s):",
             f"  {'job':22} {'ranks':>5} {'planned':>9} {'sent mb':>8} {'acked':>6} {'streams':>7} {'skipped':>7} "
             f"{'idle s':>7}  datasets / clients"]
    for job in jobs:
        planned = f"{job.num_planned_steps}{'' if job.planning_done else '+'}"
        lines.append(f"  {job.job_id:22} {job.dp_size:>5} {planned:>9} {job.num_sent_microbatches:>8} "
                     f"{job.acknowledged_step:>6} {job.num_streams:>7} {job.num_skipped:>7} {job.idle_s:>7.0f}  "
                     f"{','.join(job.datasets)} / {', '.join(job.clients) or '-'}")
        lines += [f"    warning: {warning}" for warning in job.warnings]
    return "\n".join(lines)


def _status_text(info, report) -> str:
    from collections import Counter

    total = f"of {info.num_steps}" if report.planning_done else "(planning goes on)"
    sent_steps = report.num_sent_microbatches / max(1, info.spec.dp_size * info.spec.num_microbatches)
    lines = [f"job {info.job_id}: {info.spec.dp_size} ranks x {info.spec.num_microbatches} microbatches x "
             f"{info.spec.seqs_per_microbatch} sequences of {info.spec.seq_len} tokens, {info.num_shards} shards",
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
    for cost in report.plugins:
        per = "sample" if cost.hook == "sample" else "item"
        lines.append(f"  plugin   {cost.plugin} ({cost.hook} hook): {1e3 * cost.cpu_s / max(1, cost.calls):.3f} ms "
                     f"CPU per {per} over {cost.calls} {per}s")
    return "\n".join(lines)


def add_service_commands(sub) -> None:
    """The subcommands serve, status and health on an argparse subparsers object."""
    serve = sub.add_parser("serve", help="run the service alone")
    from preprocess_service.service import settings

    settings.add_arguments(serve)
    status = sub.add_parser("status", help="every open job's progress, or one job's (--job-id)")
    status.add_argument("--address", default=os.environ.get("DISTTRAIN_ADDRESS", "127.0.0.1:50051"),
                        help="service address ($DISTTRAIN_ADDRESS; TLS and token from DISTTRAIN_TLS_* / "
                             "DISTTRAIN_AUTH_TOKEN)")
    status.add_argument("--job-id", default="", help="one job's detail (default: a line per open job, ListJobs)")
    status.add_argument("--watch", type=float, default=0, metavar="SECONDS", help="print again every SECONDS")
    status.add_argument("--timeout", type=float, default=10.0)
    health = sub.add_parser("health", help="exit 0 if the service answers SERVING")
    health.add_argument("--address", default=f"127.0.0.1:{os.environ.get('DISTTRAIN_PORT', '50051')}")
    health.add_argument("--timeout", type=float, default=3.0)
    sub.add_parser("warm", help="compile the planner's kernels into NUMBA_CACHE_DIR (images do it at build time)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TOOLS:
        print(f"error: {argv[0]!r} is a tool: python -m disttrain_tools {argv[0]} (or: disttrain {argv[0]})",
              file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="python -m preprocess_service", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_service_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands = {"serve": cmd_serve, "status": cmd_status, "health": cmd_health, "warm": cmd_warm}
    return run_command(commands[args.command], args)


def run_command(command, args) -> int:
    """Runs a CLI command; a bad request or an unreachable, refusing or unauthorised service is a
    one-line error and exit code 2, not a traceback (both CLIs use this)."""
    try:
        return command(args)
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
