"""Command line: ``python -m disttrain_tools`` (the ``disttrain`` command), every command: the tools
below and the service's own (serve, status, health: preprocess_service/service/cli.py).

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
import logging
import sys
from pathlib import Path

from disttrain_tools.jobs import add_job_args, job_config_from_args
from preprocess_service.service import cli as service_cli
from preprocess_service.service.cli import cmd_health, cmd_serve, cmd_status


def cmd_run(args) -> int:
    if not args.address and args.decode_workers != 0:  # embedded service: its slowest start first
        from preprocess_service.adapters.decode import forkserver

        forkserver.start()
    from disttrain_tools.runner import run_job, summary, write_report

    config = job_config_from_args(args)
    what = f"{len(config.datasets)} datasets" if config.datasets else f"{len(config.shards)} shard spec(s)"
    print(f"[run] {what}; service "
          f"{'at ' + args.address if args.address else 'embedded'}; {config.dp_size} client ranks",
          file=sys.stderr, flush=True)
    from preprocess_service.service.settings import ServiceSettings

    settings = ServiceSettings(allowed_shard_schemes=tuple(s.strip() for s in args.allowed_shard_schemes.split(",")
                                                           if s.strip())) \
        if args.allowed_shard_schemes else ServiceSettings()
    result = run_job(config, address=args.address, prefetch=args.prefetch, connect_timeout_s=args.connect_timeout,
                     decode_workers=args.decode_workers, settings=settings)
    print(summary(result, config))
    if args.report:
        write_report(args.report, result, config)
        print(f"report written to {args.report}")
    return 0 if result.exactly_once()["ok"] else 1


def cmd_calibrate(args) -> int:
    from disttrain_tools import calibrate

    config, _ = calibrate.calibrate(quick=args.quick)
    if args.out:
        calibrate.save(config, args.out)
        print(f"coefficients written to {args.out} (use: run --cost {args.out})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m disttrain_tools", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="one epoch through the service to client ranks, measured")
    add_job_args(run)
    run.add_argument("--address", help="use a running service at HOST:PORT instead of an embedded one")
    run.add_argument("--prefetch", type=int, default=4, help="microbatches each client reads ahead")
    run.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to wait for --address")
    run.add_argument("--report", type=Path, help="write a JSON report (keys per rank, skipped keys) here")
    run.add_argument("--decode-workers", type=int, default=None,
                     help="decode processes of the embedded service (default: one per core; 0: threads in-process)")
    run.add_argument("--allowed-shard-schemes", default=None, metavar="SCHEMES",
                     help="the embedded service's allowed shard schemes, comma-separated (default file,http,https; "
                          "add pipe to read pipe:COMMAND shards: you are the operator here)")
    service_cli.add_service_commands(sub)
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
        from disttrain_tools import synth

        return synth.main(rest)
    if args.command == "reorder":
        from disttrain_tools import reorder_cli

        return reorder_cli.main(rest)
    if args.command == "inspect":
        from disttrain_tools import inspect_cli

        return inspect_cli.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    command = {"run": cmd_run, "serve": cmd_serve, "calibrate": cmd_calibrate, "status": cmd_status,
               "health": cmd_health}.get(args.command or "run", cmd_run)
    return service_cli.run_command(command, args if args.command else parser.parse_args(["run"]))


if __name__ == "__main__":
    sys.exit(main())
