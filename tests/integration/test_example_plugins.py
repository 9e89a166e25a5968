"""The two example plugins of examples/plugins/ installed with pip, as an operator would, and run
in a job through the CLI: the CLIP filter leaves out exactly the samples under its score (read
from the shards here with tarfile), the crop changes pixels, and exactly-once holds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import webdataset as wds

from helpers import jpeg_bytes

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "plugins"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """Both example packages pip-installed (from copies: a build leaves files beside the source)."""
    root = tmp_path_factory.mktemp("plugins")
    sources = []
    for package in ("disttrain-clip-filter", "disttrain-random-crop"):
        shutil.copytree(EXAMPLES / package, root / "src" / package)
        sources.append(str(root / "src" / package))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(root / "site"), *sources], check=True, timeout=300)
    return root / "site"


def _shards(folder: Path, num_shards: int = 3, per_shard: int = 12) -> dict[str, float | None]:
    """LAION-style shards whose JSON gives a similarity (some low, one missing); key -> it."""
    folder.mkdir(parents=True)
    scores: dict[str, float | None] = {}
    for shard in range(num_shards):
        with wds.TarWriter(str(folder / f"{shard:05d}.tar")) as writer:
            for index in range(per_shard):
                key = f"{shard:05d}{index:04d}"
                score = None if index == 5 else round(0.15 + 0.02 * ((index * 7 + shard) % 13), 3)
                meta = {"caption": f"short caption {key}", "caption_long": f"a long recaption of {key}"}
                if score is not None:
                    meta["similarity"] = score
                writer.write({"__key__": key, "jpg": jpeg_bytes(160 + 8 * index, 120, seed=index),
                              "txt": f"caption {key}".encode(), "json": json.dumps(meta).encode()})
                scores[key] = score
    return scores


def _run(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "disttrain_tools", "run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_example_plugins_run_in_a_job_and_an_unknown_one_is_refused(tmp_path, site):
    scores = _shards(tmp_path / "data")
    report = tmp_path / "report.json"
    proc = _run(site, "--shards", str(tmp_path / "data"), "--seq-len", "1024", "--num-microbatches", "2",
                "--plugin", 'clip_filter={"min_score": 0.3, "caption_from": "caption_long"}',
                "--plugin", 'random_resized_crop={"scale": [0.4, 0.9]}', "--report", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    low = {key for key, score in scores.items() if score is None or score < 0.3}
    assert low and len(low) < len(scores)
    skipped = {s["key"]: s for s in data["skipped"]}
    assert set(skipped) == low and {s["kind"] for s in skipped.values()} == {"filtered"}
    assert any("no numeric 'similarity'" in s["reason"] for s in skipped.values())
    assert any("below 0.3" in s["reason"] for s in skipped.values())
    received = [k for rank in data["ranks"].values() for mb in rank["microbatches"] for k in mb["keys"]]
    assert sorted(received) == sorted(set(scores) - low)
    assert data["exactly_once"]["ok"], data["exactly_once"]
    assert "exactly-once: OK" in proc.stdout and "filtered" in proc.stdout

    refused = _run(site, "--shards", str(tmp_path / "data"), "--plugin", "no_such_plugin")
    assert refused.returncode != 0
    assert "plugin 'no_such_plugin' is not installed" in refused.stdout + refused.stderr
    assert "clip_filter" in refused.stdout + refused.stderr  # the installed ones are named


def test_the_example_plugins_change_what_they_say(tmp_path, site, monkeypatch):
    """In-process, against the installed packages: the caption is rewritten and the crop is a
    crop (different pixels, the same shape), the same for the same (seed, key, epoch)."""
    import numpy as np

    from disttrain_api.config import JobConfig, PluginConfig
    from preprocess_service.adapters.decode import InlineDecoder
    from preprocess_service.service.job import Job

    monkeypatch.syspath_prepend(str(site))
    _shards(tmp_path / "data", num_shards=1)

    def delivered(*plugins):
        job = Job(JobConfig(shards=(str(tmp_path / "data"),), seq_len=1024, num_microbatches=2, shuffle_buffer=8,
                            plugins=plugins))
        out = []
        for step in range(job.plan_all()):
            for index in range(job.step_plan(step).num_microbatches):
                out.append(job.microbatch(job.step_plan(step), 0, index, InlineDecoder()).arrays)
        job.close()
        return out

    keep = PluginConfig(name="clip_filter", params={"min_score": -1, "field": "missing_is_fine"})
    assert delivered(keep) == []  # no sample has that field: all left out, none delivered
    caption = PluginConfig(name="clip_filter", params={"min_score": 0.0, "caption_from": "caption_long"})
    crop = PluginConfig(name="random_resized_crop", params={"scale": [0.3, 0.6], "flip": 1.0})
    plain, cropped, again = delivered(caption), delivered(caption, crop), delivered(caption, crop)
    tokens = b"".join(bytes(a["tokens"][(a["modality"] == 1) & (a["tokens"] < 256)].astype(np.uint8)) for a in plain)
    assert b"a long recaption of" in tokens and b"short caption" not in tokens
    assert len(plain) == len(cropped)
    for p, c, g in zip(plain, cropped, again):
        assert p["pixels"].shape == c["pixels"].shape and not np.array_equal(p["pixels"], c["pixels"])
        np.testing.assert_array_equal(c["pixels"], g["pixels"])
    with tarfile.open(tmp_path / "data" / "00000.tar") as tar:  # the shards are left as they were
        assert b"short caption" in tar.extractfile(tar.getmember("000000000.json")).read()
