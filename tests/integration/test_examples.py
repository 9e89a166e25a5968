"""The examples of examples/ run as a user runs them (torchrun), at small size on the CPU, against
a real service: a plain DDP loop over a small Hugging Face causal LM with images through
ServiceDataset and a DataLoader, and our disaggregated trainer."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from disttrain_api.config import MONOLITHIC, JobConfig
from disttrain_tools import synth
from preprocess_service.service.server import create_server

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("example-shards")
    synth.main(["--out", str(root), "--num-shards", "1", "--samples-per-shard", "120", "--seed", "5"])
    server, port, servicer = create_server("127.0.0.1:0", decode_workers=0)
    yield f"127.0.0.1:{port}", str(root), servicer
    server.stop(0).wait()


def _torchrun(nproc: int, script: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(REPO / "examples" / script), *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_a_plain_ddp_loop_trains_a_hugging_face_lm_through_the_dataset_adapter(service, tmp_path):
    address, shards, servicer = service
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    done = _torchrun(2, "ddp_loop.py", "--address", address, "--shards", shards, "--steps", "4",
                     "--seq-len", "1024", "--log-json", str(log), "--save-state", str(ckpt), "--calibrate-steps", "2")
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert len(losses) == 4 and all(math.isfinite(x) and x > 0 for x in losses), losses
    states = [json.loads((tmp_path / f"ckpt.rank{r}.json").read_text()) for r in range(2)]
    assert [(s["dp_rank"], s["next_step"], s["next_microbatch"]) for s in states] == [(0, 4, 0), (1, 4, 0)]
    config = JobConfig(shards=(shards,), seq_len=1024, dp_size=2, num_microbatches=2, stage_map=MONOLITHIC,
                       seed=0, cost_feedback=True)
    job = servicer.jobs.get(config.job_id())
    assert job.state_dict()["acked"] == {"0": 4, "1": 4}, "saving the data position acknowledged it"
    # steps 1 and 2 timed (step 0 warms up): 2 ranks x 2 microbatches x 2 steps refit the costs
    assert "costs refit from 8 timed microbatches" in done.stdout, done.stdout[-2000:]
    assert job.plans.planner.cost != config.cost, "the trainer's own timings replaced the configured costs"
    print("\n".join(done.stdout.strip().splitlines()[-4:]))


def test_the_disaggregated_example_runs_our_trainer(service, tmp_path):
    address, shards, _ = service
    log = tmp_path / "log.jsonl"
    _torchrun(4, "disaggregated.py", "--address", address, "--shards", shards, "--steps", "2",
              "--seq-len", "512", "--log-json", str(log))  # shorter sequences than its own: any flag may follow
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and all(math.isfinite(r["loss"]) for r in records)
