"""``python -m disttrain_tools reorder plan INSTANCE.json --algorithm NAME -o PLAN.json``
and ``... evaluate INSTANCE.json PLAN.json``: plan or judge any instance in the JSON forms of
preprocess_service.core.reorder.instance. ``plan`` prints the plan's figures with its planning time
(``planning_s``, warm) and the JIT's (``jit_s``: compiling the kernels or loading their cache, first)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from disttrain_api.config import JobConfig, field_defaults
from preprocess_service.core import reorder
from preprocess_service.core.reorder.instance import PLAN_FORMAT, PLANNERS, Instance, evaluate, plan_instance


def load_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m disttrain_tools reorder", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="plan an instance")
    plan.add_argument("instance", type=Path)
    plan.add_argument("--algorithm", default=field_defaults(JobConfig)["reorder_algorithm"],
                      help=f"one of {sorted(PLANNERS)} (default: the service's, "
                           f"{field_defaults(JobConfig)['reorder_algorithm']})")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("-o", "--output", type=Path, required=True)
    judge = sub.add_parser("evaluate", help="iteration time of a plan (exact 1F1B simulator) vs the lower bound")
    judge.add_argument("instance", type=Path)
    judge.add_argument("plan", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        instance = Instance.from_json(load_json(args.instance))
        if args.command == "plan":
            start = time.perf_counter()
            reorder.warm_up()  # the JIT (or loading its cache) apart, so time_s is the planning alone
            jit_s = time.perf_counter() - start
            result = plan_instance(instance, args.algorithm, args.seed)
            args.output.write_text(json.dumps(result))
            figures = evaluate(instance, np.array(result["plan"])) | {
                "planning_s": result["meta"]["time_s"], "jit_s": jit_s}
        else:
            data = load_json(args.plan)
            if data.get("format") != PLAN_FORMAT:
                raise ValueError(f"plan format is {data.get('format')!r}, expected {PLAN_FORMAT!r}")
            figures = evaluate(instance, np.array(data["plan"]))
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
