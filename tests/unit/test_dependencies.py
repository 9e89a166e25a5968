"""The dependencies as a library declares them: ranges in pyproject.toml, exact versions in
requirements/lock.txt (and requirements/torch.txt), and every locked version inside its range, so
what CI tests is what the ranges promise."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
LOCKED_EXTRAS = ("service", "trainer", "dev")


def _pins(path: Path) -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        assert match, f"{path.name}: not an exact pin: {line!r}"
        name = canonicalize_name(match.group(1))
        assert name not in pins, f"{path.name} pins {name} twice"
        pins[name] = Version(match.group(2))
    return pins


def _requirements() -> list[Requirement]:
    out = [Requirement(r) for r in PROJECT["dependencies"]]
    for extra in LOCKED_EXTRAS:
        out += [Requirement(r) for r in PROJECT["optional-dependencies"][extra]]
    return out


def test_the_base_dependencies_are_ranges_not_pins():
    for text in PROJECT["dependencies"]:
        requirement = Requirement(text)
        assert not any(s.operator in ("==", "===") for s in requirement.specifier), text
        assert any(s.operator == ">=" for s in requirement.specifier), f"{text}: a lower bound from evidence"
    assert Requirement(f"python{PROJECT['requires-python']}").specifier.contains("3.12")


def test_every_locked_version_lies_in_its_declared_range():
    lock = _pins(REPO / "requirements" / "lock.txt")
    torch = _pins(REPO / "requirements" / "torch.txt")
    assert list(torch) == ["torch"] and "torch" not in lock  # the index picks torch's build
    assert not [n for n in lock if n.startswith(("nvidia-", "triton"))], "the lock resolved a CUDA torch's libraries"
    pins = {**lock, **torch}
    for requirement in _requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is declared but not locked (run requirements/update-lock.sh)"
        assert requirement.specifier.contains(pins[name], prereleases=True), \
            f"{name}=={pins[name]} (locked) is outside {requirement} (declared)"


def test_the_generated_stubs_need_no_more_than_the_declared_floors():
    """The committed gRPC stubs check the runtime: grpcio >= the grpcio-tools that made them and a
    protobuf of the gencode's major version; the declared lower bounds must be at least those."""
    grpc_stub = (REPO / "disttrain_api" / "preprocess_pb2_grpc.py").read_text()
    made_by = Version(re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc_stub).group(1))
    gencode = re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),",
                        (REPO / "disttrain_api" / "preprocess_pb2.py").read_text())
    protobuf_floor = Version(".".join(gencode.groups()))
    base = {canonicalize_name(r.name): r for r in map(Requirement, PROJECT["dependencies"])}
    assert not base["grpcio"].specifier.contains(Version(f"{made_by.major}.{made_by.minor}.{made_by.micro - 1}")
                                                 if made_by.micro else Version(f"{made_by.major}.{made_by.minor - 1}"))
    assert base["grpcio"].specifier.contains(made_by)
    assert base["protobuf"].specifier.contains(protobuf_floor)
    assert not base["protobuf"].specifier.contains(Version(f"{protobuf_floor.major + 1}.0"))
    older = Version(f"{protobuf_floor.major}.{protobuf_floor.minor - 1}") if protobuf_floor.minor else None
    assert older is None or not base["protobuf"].specifier.contains(older)
