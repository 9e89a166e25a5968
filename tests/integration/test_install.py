"""Installing the project as a user does, into a trainer environment of their own: `python -m
build` makes a wheel and an sdist; the wheel's [client] installs into a fresh virtualenv that
already holds torch without touching it, and its client reads microbatches from our service; and
a resolver dry run into an environment holding only the oldest torch, grpcio and protobuf we
declare (stub distributions of those versions) installs nothing but the project and what is missing."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from disttrain_api.config import JobConfig
from helpers import write_tiny_shards
from preprocess_service.service.server import create_server

REPO = Path(__file__).resolve().parents[2]


def _run(*args, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kw)
    assert done.returncode == 0, f"{args[:4]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The wheel and sdist, built from a copy of the tracked files (a build writes beside them)."""
    root = tmp_path_factory.mktemp("build")
    files = _run("git", "ls-files", cwd=REPO).stdout.split()
    source = root / "src"
    for name in files:
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((REPO / name).read_bytes())
    _run(sys.executable, "-m", "build", "--wheel", "--sdist", "--no-isolation", "--outdir", root / "dist", source)
    wheel, = (root / "dist").glob("disttrain-*.whl")
    sdist, = (root / "dist").glob("disttrain-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist, "root": root}


def _venv(path: Path) -> tuple[Path, Path]:
    """A fresh virtualenv: its python and its site-packages."""
    _run(sys.executable, "-m", "venv", path)
    python = path / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    return python, site


def _closure(name: str) -> set[str]:
    """``name`` and every distribution it needs here (extras and markers that do not apply left out)."""
    seen, todo = set(), [name]
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower()
        if key in seen:
            continue
        seen.add(key)
        for text in dist.requires or []:
            if "extra ==" in text:
                continue
            from packaging.requirements import Requirement

            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate():
                try:
                    importlib.metadata.distribution(requirement.name)
                except importlib.metadata.PackageNotFoundError:
                    continue
                todo.append(requirement.name)
    return seen


def _hold(folder: Path, names: set[str]) -> None:
    """``folder`` holds these installed distributions (links to their files and metadata), as a
    trainer image holds its torch."""
    folder.mkdir()
    for name in names:
        dist = importlib.metadata.distribution(name)
        base = Path(dist.locate_file(""))
        for top in {Path(f).parts[0] for f in dist.files or []}:
            if top != ".." and not (folder / top).exists() and (base / top).exists():
                (folder / top).symlink_to(base / top)


def _stub(folder: Path, name: str, version: str) -> None:
    """An installed distribution of ``name`` at ``version`` as far as a resolver can tell."""
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("stub\n")


def test_the_wheel_installs_beside_an_existing_torch_and_its_client_reads_from_the_service(built, tmp_path):
    python, site = _venv(tmp_path / "venv")
    held = tmp_path / "trainer-image"
    _hold(held, _closure("torch"))
    (site / "trainer_image.pth").write_text(str(held) + "\n")
    torch_before = _run(python, "-c", "import torch; print(torch.__version__, torch.__file__)").stdout.split()
    assert torch_before[0] == importlib.metadata.version("torch")

    report = tmp_path / "report.json"
    _run(python, "-m", "pip", "install", "-q", "--report", report, f"{built['wheel']}[client]")
    installed = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "disttrain" in installed and "torch" not in installed and not any(n.startswith("nvidia") for n in installed)
    torch_after = _run(python, "-c", "import torch; print(torch.__version__, torch.__file__)").stdout.split()
    assert torch_after == torch_before, "the user's torch was replaced"
    print(f"installed {sorted(installed)} beside torch {torch_after[0]} (kept)")

    write_tiny_shards(tmp_path / "data", num_shards=1, samples_per_shard=8)
    server, port, _ = create_server("127.0.0.1:0", decode_workers=0)
    config = JobConfig(shards=(str(tmp_path / "data"),), seq_len=1024, num_microbatches=2)
    script = ("import json, sys\n"
              "from disttrain_api.config import JobConfig\n"
              "from trainer.client import DataClient\n"
              "config = JobConfig(**json.loads(sys.argv[2]))\n"
              "with DataClient(sys.argv[1], config, 0) as client:\n"
              "    batches = list(client)\n"
              "keys = sorted(k for mb in batches for k in mb.sample_keys)\n"
              "print(json.dumps({'keys': keys, 'service_modules': sorted(m for m in sys.modules\n"
              "                  if m.startswith(('preprocess_service', 'numba', 'webdataset', 'PIL')))}))\n")
    try:
        done = _run(python, "-c", script, f"127.0.0.1:{port}",
                    json.dumps({"shards": list(config.shards), "seq_len": 1024, "num_microbatches": 2}),
                    cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    finally:
        server.stop(0).wait()
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["keys"] == sorted(f"00000{i:04d}" for i in range(8))
    assert result["service_modules"] == [], "the client imported the service's side"


def test_a_resolver_dry_run_against_the_oldest_declared_versions_installs_only_what_is_missing(built, tmp_path):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    floors = {}
    for text in project["dependencies"]:
        name, floor = re.match(r"([a-z0-9_.-]+)>=([0-9.]+)", text).groups()
        floors[name] = floor
    assert set(floors) == {"torch", "numpy", "grpcio", "protobuf"}
    python, site = _venv(tmp_path / "venv")
    stubs = tmp_path / "oldest"
    for name in ("torch", "grpcio", "protobuf"):
        _stub(stubs, name, floors[name])
    (site / "oldest.pth").write_text(str(stubs) + "\n")
    report = tmp_path / "report.json"
    _run(python, "-m", "pip", "install", "-q", "--dry-run", "--report", report, f"{built['wheel']}[client]")
    would = {item["metadata"]["name"].lower(): item["metadata"]["version"]
             for item in json.loads(report.read_text())["install"]}
    assert set(would) == {"disttrain", "numpy"}, would  # torch, grpcio and protobuf at their floors are kept
    print(f"against torch {floors['torch']}, grpcio {floors['grpcio']}, protobuf {floors['protobuf']}: "
          f"would install {would}")
    sdist_files = _run("tar", "-tzf", built["sdist"]).stdout.split()
    assert any(f.endswith("protos/disttrain_api/preprocess.proto") for f in sdist_files)
