"""The disaggregated runtime (gloo, CPU) against the single-process reference: its ranks started as
torchrun starts them, and under torchrun itself where a run is killed and restarted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from disttrain_api.layout import PipelineLayout, stage_order
from disttrain_tools import synth
from preprocess_service.service.server import create_server
from trainer import DataClient
from trainer.models.config import ModelConfig
from trainer.models.mllm import MultimodalModel, microbatch_seed, step_loss
from trainer.runtime.workers import BackboneWorker, EncoderWorker, GeneratorWorker
from trainer.train import fill_missing_grads, job_config, parse

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-shards")
    synth.main(["--out", str(root), "--num-shards", "1", "--samples-per-shard", "160", "--seed", "4"])
    server, port, servicer = create_server("127.0.0.1:0", decode_workers=0)
    yield f"127.0.0.1:{port}", str(root), servicer
    server.stop(0).wait()


def _ranks(nproc: int, args: list[str], timeout: float = 240) -> tuple[int, str]:
    """``trainer.train`` in ``nproc`` processes started as torchrun starts its workers (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: the env:// rendezvous, rank 0 holding the
    store), without torchrun's agent, whose own start costs each run a torch import: for the runs
    that need no restart. (exit code: the first rank's that failed, else 0; the ranks' output.)
    A rank that fails ends the others (they would wait for it in a collective)."""
    import socket
    import tempfile
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
           "LOCAL_WORLD_SIZE": str(nproc), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile("w+") as out:
        procs = [subprocess.Popen([sys.executable, "-m", "trainer.train", *args], cwd=REPO, stdout=out,
                                  stderr=subprocess.STDOUT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
                 for r in range(nproc)]
        deadline, code = time.monotonic() + timeout, 0
        try:
            while any(p.poll() is None for p in procs):
                failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    code = failed[0] if failed else -9
                    break
                time.sleep(0.05)
            else:
                code = next((p.returncode for p in procs if p.returncode), 0)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        out.seek(0)
        return code, out.read()


def _run(nproc: int, args: list[str], timeout: float = 240) -> None:
    code, output = _ranks(nproc, args, timeout)
    assert code == 0, output[-6000:]


def _torchrun(nproc: int, args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "trainer.train", *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _args(address, shards, tmp_path, steps, layout=("1", "2", "1", "1"), extra=(), microbatches=3):
    """layout: enc DP, bb DP, bb PP, gen DP[, enc TP, bb TP, gen TP]."""
    tp = layout[4:] or ("1", "1", "1")
    return ["--address", address, "--shards", shards, "--enc-dp", layout[0], "--bb-dp", layout[1],
            "--bb-pp", layout[2], "--gen-dp", layout[3], "--enc-tp", tp[0], "--bb-tp", tp[1], "--gen-tp", tp[2],
            "--steps", str(steps), "--num-microbatches", str(microbatches),
            "--seq-len", "512", "--model-layers", "2", "--log-json", str(tmp_path / "log.jsonl"),
            "--profile-microbatches", "0", *extra]


def _reference(argv: list[str], steps: int):
    """The same steps in one process: the whole model, every rank's microbatches, one optimizer."""
    args = parse(argv)
    torch.manual_seed(args.seed)
    model = MultimodalModel(ModelConfig(layers=args.model_layers, max_positions=args.seq_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    clients = [DataClient(args.address, job_config(args), d, prefetch=args.num_microbatches)
               for d in range(args.bb_dp)]
    losses = []
    for step in range(steps):
        parts = []
        for d, client in enumerate(clients):
            while True:  # the last step of an epoch may have fewer microbatches
                mb = next(client)
                seed = microbatch_seed(args.seed, step, d, mb.microbatch_index)
                parts.append(model(mb, torch.Generator().manual_seed(seed)))
                if mb.microbatch_index + 1 == mb.num_microbatches:
                    break
        loss = step_loss(parts, model.config.gen_loss_weight)
        loss.backward()
        fill_missing_grads(list(model.parameters()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    for client in clients:
        client.close()
    return model, losses, args


def _worker_params(model, args, role):
    layout = PipelineLayout(args.enc_dp, args.bb_dp, args.bb_pp, args.gen_dp)  # unsharded: the full parameters
    common = (model, layout, args.num_microbatches, args.seed)
    if role[0] == "enc":
        return EncoderWorker(*common, replica=role[1]).parameters()
    if role[0] == "gen":
        return GeneratorWorker(*common, replica=role[1], gen_weight=1.0).parameters()
    return BackboneWorker(*common, dp=role[1], stage=role[2]).parameters()


def test_one_f_one_b_order():
    assert stage_order(3, 4, 0) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert stage_order(3, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    layout = PipelineLayout(enc_dp=1, bb_dp=2, bb_pp=1, gen_dp=1)
    ops = layout.ops(0, 2)
    assert ops[:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1)]  # (op, chain, microbatch), slot by slot
    assert [layout.role(r) for r in range(layout.world_size)] == [("enc", 0), ("bb", 0, 0), ("bb", 1, 0), ("gen", 0)]


@pytest.mark.parametrize("layout", [("2", "2", "1", "1"), ("1", "2", "2", "1"), ("0", "1", "2", "0"),
                                    ("1", "1", "1", "1", "2", "2", "2"), ("0", "2", "1", "0", "1", "2", "1")],
                         ids=["enc-dp2-gen-shared", "bb-dp2-pp2", "monolithic-pp2", "tp2-every-module",
                              "monolithic-dp2-tp2"])
def test_disaggregated_run_matches_the_single_process_reference(service, tmp_path, layout):
    """Twice as many microbatches as pipeline stages (at least 4), so stage 0 posts several
    microbatches' media before the encoder returns its first gradient: with messages matched in
    posting order (p2p.py: no tags, as NCCL) a wrong order between two ranks would hand a
    receiver another kind's tensors. The step's ops make no host sync, its end one."""
    address, shards, servicer = service
    steps = 2
    stages = PipelineLayout(*(int(v) for v in layout)).num_stages
    argv = _args(address, shards, tmp_path, steps, layout, ["--save-params", str(tmp_path / "params"),
                                                             "--count-host-syncs"], microbatches=max(2 * stages, 4))
    tp = [int(t) for t in layout[4:] or ("1", "1", "1")]
    nproc = int(layout[0]) * tp[0] + int(layout[1]) * int(layout[2]) * tp[1] + int(layout[3]) * tp[2]
    _run(nproc, argv)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["host_syncs_max"] for r in records] == [1] * steps, "one host sync per step (reading the loss)"
    logged = [r["loss"] for r in records]
    model, losses, args = _reference(argv, steps)
    sharded = 0
    assert logged == pytest.approx(losses, rel=1e-5)
    for path in sorted((tmp_path / "params").glob("rank*.pt")):
        saved = torch.load(path, weights_only=False)
        expected = _worker_params(model, args, tuple(saved["role"]))
        assert len(saved["params"]) == len(expected)
        for got, want, spec in zip(saved["params"], expected, saved["shards"]):
            want = want.detach() if spec is None else want.detach().index_select(*spec)  # a TP rank's shard
            # TP sums partial products in another order; where a gradient is near 0, AdamW's g / sqrt(v)
            # turns that rounding into up to a few % of one lr-sized update: 5e-5 = 5% of lr 1e-3
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 if tp == [1, 1, 1] else 5e-5)
        sharded += sum(spec is not None for spec in saved["shards"])
    assert (sharded > 0) == (tp != [1, 1, 1])


def test_one_channel_for_every_message_kind_fails_as_nccl_would(service, tmp_path):
    """What the per-kind channels prevent, shown on gloo: with every kind on one channel and no tags
    (NCCL's matching), backbone stage 0 posts all its microbatches' media before the encoder asks
    for the first embedding gradient, so once M > P the encoder receives media where it expects a
    gradient and the run fails. (With gloo's tags it passed: the CPU tests could not see this.)"""
    address, shards, _ = service
    argv = _args(address, shards, tmp_path, 1, ("1", "1", "1", "1"), ["--p2p-channels", "shared", "--seed", "12"],
                 microbatches=6)
    code, output = _ranks(3, argv)
    assert code != 0, "one shared channel at M > P should mismatch messages"
    assert "Mismatch in shape" in output, output[-3000:]  # media where embed_grad was expected


def _kill_all(marker: str) -> None:
    """SIGKILL every process whose command line holds ``marker``, as a node failure would."""
    import os
    import signal

    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_kill_and_resume_from_a_checkpoint_reproduces_the_uninterrupted_run_which_learns(service, tmp_path):
    """A dozen steps, checkpointed every 3, killed after the first checkpoint and restarted: every
    logged loss is the single-process reference's, and the loss falls over the dozen steps. With
    --feedback, every microbatch's measured stage times reach the service, which refits its cost
    model (the plans the run reads were made before: its data is the reference's)."""
    import time

    address, shards, servicer = service
    steps = 12  # checkpoints after steps 2, 5, 8; killed after the first
    run = tmp_path / "killed"
    run.mkdir()
    argv = _args(address, shards, run, steps, extra=["--checkpoint-dir", str(run / "ckpt"), "--checkpoint-every", "3",
                                                     "--lr", "3e-3", "--feedback"])
    # the uninterrupted run's losses: the single-process reference of the same steps (which the
    # disaggregated runs match: test_disaggregated_run_matches_the_single_process_reference)
    expected = dict(enumerate(_reference(argv, steps)[1]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "trainer.train", *argv]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    log = run / "log.jsonl"
    deadline = time.monotonic() + 240
    while not (log.exists() and len(log.read_text().splitlines()) >= 5):  # past the step-3 checkpoint
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before the kill"
        time.sleep(0.05)
    _kill_all(str(run / "ckpt"))  # torchrun and every worker (elastic starts them in their own sessions)
    proc.wait()
    killed_after = len(log.read_text().splitlines())
    assert killed_after < steps, "killed before the end"
    _torchrun(4, argv)  # restarts from the newest complete checkpoint
    records = [json.loads(line) for line in log.read_text().splitlines()]
    resumed = records[killed_after:]
    first = resumed[0]["step"]
    assert first % 3 == 0 and 3 <= first < killed_after, "resumed at a checkpoint before the kill"
    assert [r["step"] for r in resumed] == list(range(first, steps))
    job = servicer.jobs.get(job_config(parse(argv)).job_id())
    assert job.state_dict()["acked"] == {str(r): steps for r in range(job.config.dp_size)}, \
        "every data rank acknowledged the last committed checkpoint"
    from disttrain_api.errors import NotFoundError

    with pytest.raises(NotFoundError, match="acknowledged"):
        job.step_plan(steps - 1)  # the plans before the acknowledged step were dropped
    assert job.plans.num_held_plans() <= steps, "only the steps the streams read ahead are held"
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("disttrain_job_acknowledged_step", {"job": job.job_id}) == steps
    assert REGISTRY.get_sample_value("disttrain_job_held_plans", {"job": job.job_id}) == job.plans.num_held_plans()
    assert [r["loss"] for r in resumed] == pytest.approx([expected[r["step"]] for r in resumed], rel=1e-5)
    assert [r["loss"] for r in records[:killed_after]] == pytest.approx(
        [expected[r["step"]] for r in records[:killed_after]], rel=1e-5)
    losses = [expected[s] for s in range(steps)]
    assert sum(losses[-4:]) / 4 < 0.85 * sum(losses[:4]) / 4, losses
    # --feedback: the measured stage times reached the service, which refit its cost model
    assert job.plans.refitter.num_observations >= steps * 2
    assert job.plans.planner.cost.bb_linear_s != job.config.cost.bb_linear_s
    # and the measured bubble reached the service's metrics, beside the simulator's prediction
    from preprocess_service.adapters.infra.metrics import BUBBLE

    assert 0 < BUBBLE.labels(job.job_id, "measured")._value.get() < 1


def test_a_run_restarted_with_fewer_processes_continues_its_epoch(service, tmp_path):
    """Elastic restart: a 4-process run (backbone DP 2) checkpointed at step 3 restarts with 3
    processes (backbone DP 1). It continues at step 3 with the checkpoint's weights, and its data
    continues the job's lineage: the samples of steps 0-5 are the lineage's stream (2 ranks' global
    batches, then 1 rank's), none twice."""
    from disttrain_api.errors import NotFoundError
    from preprocess_service.service.job import Job

    address, shards, servicer = service
    run = tmp_path / "elastic"
    run.mkdir()
    extra = ["--checkpoint-dir", str(run / "ckpt"), "--checkpoint-every", "3", "--seed", "23",
             "--keys-log", str(run / "keys")]
    first = _args(address, shards, run, 3, extra=extra)
    _torchrun(4, first)
    second = _args(address, shards, run, 6, layout=("1", "1", "1", "1"), extra=extra)
    _torchrun(3, second)
    assert [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()] == list(range(6))
    old, new = (job_config(parse(argv)) for argv in (first, second))
    assert (old.dp_size, new.dp_size) == (2, 1) and old.lineage_id() == new.lineage_id()
    job = servicer.jobs.get(new.job_id())
    with pytest.raises(NotFoundError):
        job.step_plan(2)  # the new layout's job began at the checkpoint, not at step 0
    assert job.state_dict()["acked"] == {"0": 6}
    received: dict[int, list[str]] = {}
    for path in (run / "keys").glob("*.keys"):
        for line in path.read_text().splitlines():
            step, key = line.split(" ", 1)
            received.setdefault(int(step), []).append(key)
    reference = Job(old)  # the lineage's stream, planned here from scratch
    want = {s: [d.key for d in reference.step_plan(s).documents()] for s in range(3)}
    for rank in range(old.dp_size):
        reference.acknowledge(rank, 3)
    continued = Job(new)
    continued.load_state_dict(reference.state_dict())
    want.update({s: [d.key for d in continued.step_plan(s).documents()] for s in range(3, 6)})
    assert {s: sorted(k) for s, k in received.items()} == {s: sorted(k) for s, k in want.items()}
    every = [k for keys in received.values() for k in keys]
    assert len(every) == len(set(every)), "no sample twice across the restart"


def test_bf16_autocast_runs_the_same_code_and_stays_near_the_fp32_losses(service, tmp_path):
    """--bf16 (autocast; the GPU path's option, run here on the CPU) trains the same steps: the
    losses are bf16-close to fp32's (the single-process reference's, which the fp32 runs match:
    test_disaggregated_run_matches_the_single_process_reference), and not equal (autocast was on)."""
    address, shards, _ = service
    # a job of its own (seed): other tests acknowledge past step 0 of the default one
    argv = _args(address, shards, tmp_path, 2, ("1", "1", "1", "1"), ["--seed", "11", "--bf16", "--device", "cpu"])
    fp32 = _reference(argv, 2)[1]  # before the run, which may acknowledge its steps
    _run(3, argv)
    bf16 = [json.loads(line)["loss"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert bf16 == pytest.approx(fp32, rel=0.05)
    assert bf16 != fp32


def test_microbatch_to_moves_every_tensor_and_pinning_needs_cuda(service):
    address, shards, _ = service
    argv = ["--address", address, "--shards", shards, "--seq-len", "2048", "--profile-microbatches", "0"]
    with DataClient(address, job_config(parse(argv)), 0, prefetch=1, pin_memory=True) as client:
        assert client.pin_memory == torch.cuda.is_available()
        mb = next(client)
    moved = mb.to("meta")  # a device without data: every tensor must land there
    assert all(getattr(moved, name).device.type == "meta" for name in mb.TENSORS)
    assert all(t.device.type == "meta" for t in [*moved.images, *moved.mels])
    assert moved.sample_keys == mb.sample_keys and mb.tokens.device.type == "cpu"
