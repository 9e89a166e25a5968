"""Regenerates the gRPC modules in disttrain_api/ from protos/ (``python -m disttrain_api.protogen``).

The generated files are committed; tests/unit/disttrain_api/test_protos.py regenerates into a temporary folder and
fails when the committed copies differ.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
GENERATED_PACKAGE = "disttrain_api"


def proto_files() -> list[Path]:
    """Every .proto of the project, relative to PROTO_ROOT, sorted."""
    return sorted(p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc for every proto into ``out_dir``; returns the files written."""
    from grpc_tools import protoc  # dev dependency, imported only here

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *[str(p) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in (out_dir / GENERATED_PACKAGE).glob("*_pb2*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
