"""The peers' own environment for bench/peers.py (``--setup``): a venv beside the repository,
never the project's dependencies.

torch==2.13.0 (the local CPU wheel) goes in first; every later group is resolved with
``pip install --dry-run`` and refused if it would bring any CUDA package or another torch. A group
that fails to resolve or install is recorded with pip's last lines, and its peer is skipped.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS_VENV = REPO / ".venv-peers"
RESULTS = PEERS_VENV / "peers-setup.json"

# peer name -> pip requirements; the order is the install order.
GROUPS: dict[str, list[str]] = {
    "base": ["numpy", "pillow", "simplejpeg", "psutil", "webdataset==1.0.2", "soundfile"],
    "tf.data service": ["tensorflow-cpu"],
    "Ray Data": ["ray[data]"],
    "Megatron-Energon": ["megatron-energon"],
    "MosaicML Streaming": ["mosaicml-streaming"],
}
_FORBIDDEN = re.compile(r"\b(nvidia-[\w-]+|torch-\d|triton-\d|torch==(?!2\.13\.0))", re.I)


def python() -> Path:
    return PEERS_VENV / "bin" / "python"


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python()), "-m", "pip", *args], capture_output=True, text=True)


def _install(requirements: list[str]) -> str | None:
    """None when installed, else the reason it was not."""
    dry = _pip("install", "--dry-run", *requirements)
    if dry.returncode != 0:
        return "does not resolve: " + " | ".join(dry.stderr.strip().splitlines()[-3:])
    would = " ".join(line for line in dry.stdout.splitlines() if line.startswith("Would install"))
    bad = sorted(set(m.group(0) for m in _FORBIDDEN.finditer(would)))
    if bad:
        return f"refused: it would install {', '.join(bad)} (a CUDA build or another torch)"
    done = _pip("install", *requirements)
    if done.returncode != 0:
        return "install failed: " + " | ".join(done.stderr.strip().splitlines()[-3:])
    return None


def setup() -> dict[str, str]:
    """Create the venv if needed and install every group; returns {peer: "ok" | reason}."""
    if not python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
    torch = _pip("install", "torch==2.13.0")
    if torch.returncode != 0:
        raise SystemExit(f"torch==2.13.0 did not install in {PEERS_VENV}: {torch.stderr[-500:]}")
    results = {}
    for peer, requirements in GROUPS.items():
        reason = _install(requirements)
        results[peer] = "ok" if reason is None else reason
        print(f"[setup] {peer:20s} {' '.join(requirements):40s} {results[peer]}", flush=True)
    versions = _pip("list", "--format=json")
    RESULTS.write_text(json.dumps({"peers": results, "packages": json.loads(versions.stdout or "[]")}, indent=1))
    return results


def installed() -> dict[str, str]:
    """What the last ``--setup`` recorded ({} if it never ran)."""
    return json.loads(RESULTS.read_text())["peers"] if RESULTS.exists() else {}


if __name__ == "__main__":
    setup()
