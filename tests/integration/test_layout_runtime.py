"""The trainer's runtime under torchrun runs the work the service's simulator predicts for its
layout (tests/unit/disttrain_api/test_layout.py: the layout and simulator themselves)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from disttrain_api.config import JobConfig
from disttrain_api.layout import PipelineLayout
from disttrain_tools import synth
from preprocess_service.core.simulate import replica_ops
from preprocess_service.service.server import create_server
from trainer.runtime.workers import message_pairs

REPO = Path(__file__).resolve().parents[2]


def _trace_run(tmp_path: Path, address: str, shards: str, argv: list[str], nproc: int) -> dict[int, dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "trainer.train", "--address", address, "--shards", shards, "--steps", "2", "--seq-len", "512",
           "--model-layers", "2", "--trace", str(tmp_path / "trace"), *argv]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in (tmp_path / "trace").glob("rank*.json")}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout-shards")
    synth.main(["--out", str(root), "--num-shards", "1", "--samples-per-shard", "120", "--seed", "9"])
    server, port, _ = create_server("127.0.0.1:0", decode_workers=0)
    yield f"127.0.0.1:{port}", str(root)
    server.stop(0).wait()


@pytest.mark.parametrize("argv,nproc", [
    (["--enc-dp", "4", "--bb-dp", "2", "--bb-pp", "1", "--gen-dp", "1", "--num-microbatches", "6"], 7),
    (["--orchestrate", "--global-batch", "4"], 4),
], ids=["split-encoder-shared-generator", "orchestrated"])
def test_the_runtime_runs_the_work_the_simulator_predicts(service, tmp_path, argv, nproc):
    """A few real steps under torchrun: the job the service plans is the layout the trainer runs
    (stage map, shared/split replicas, the trainer's measured costs), and every rank's executed
    ops (which microbatch of which chain, forward or backward, in which order; encoder and
    generator read the chain and microbatch from the messages they received) are the simulator's
    prediction for that stage replica."""
    address, shards = service
    traces = _trace_run(tmp_path, address, shards, argv, nproc)
    assert sorted(traces) == list(range(nproc))
    layout = PipelineLayout(**traces[0]["layout"])
    model = layout.stage_model()
    readers = [t for t in traces.values() if "job" in t]
    assert len(readers) == layout.bb_dp and len({t["job"]["job_id"] for t in readers}) == 1
    job = readers[0]["job"]
    assert tuple(job["stage_map"]) == model.stage_map
    assert (job["enc_shared_by"], job["gen_shared_by"]) == (model.shared_by[0], model.shared_by[2])
    assert (max(1, job["enc_split_by"]), max(1, job["gen_split_by"])) == (model.split_by[0], model.split_by[2])
    assert job["cost"]["bb_linear_s"] > 0 and job["cost"]["bb_linear_s"] != JobConfig(shards=("s",)).cost.bb_linear_s
    assert job["cost"]["enc_quadratic_s"] == 0.0  # the trainer's linear fit, sent as is
    # every message went over a connection opened at start-up (NCCL connects lazily, and a first send
    # inside a step blocks its host until the receiver posts: p2p.connect)
    opened = set(message_pairs(layout, max(traces[0]["steps"][s]["num_microbatches"] for s in ("0", "1"))))
    sent = {(kind, rank, dst) for rank, trace in traces.items() for kind, dst in trace["sent"]}
    assert sent <= opened and bool(sent) == bool(opened), sorted(sent - opened)
    rng = np.random.default_rng(0)
    for step in ("0", "1"):
        M = traces[0]["steps"][step]["num_microbatches"]
        P = model.num_stages
        predicted = replica_ops(model, rng.lognormal(0, 1, (layout.bb_dp, P, M)),
                                rng.lognormal(0, 1, (layout.bb_dp, P, M)))
        for rank, trace in traces.items():
            role = trace["role"]
            if role[0] == "enc":
                key = (0, role[1])
            elif role[0] == "gen":
                key = (P - 1, role[1])
            else:
                key = (layout.chain_stage(role[2]), role[1])
            executed = [tuple(op) for op in trace["steps"][step]["ops"]]
            assert executed == predicted.get(key, []), f"rank {rank} {role} step {step}"
