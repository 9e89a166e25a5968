"""The committed generated modules must match what protoc makes from protos/ now."""

from pathlib import Path

from disttrain_api import protogen


def test_generated_code_is_fresh(tmp_path: Path):
    written = protogen.generate(tmp_path)
    assert written, "protoc generated nothing"
    for fresh in written:
        committed = protogen.REPO_ROOT / protogen.GENERATED_PACKAGE / fresh.name
        assert committed.exists(), f"{committed} is missing: run python -m disttrain_api.protogen"
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.name} is stale: run python -m disttrain_api.protogen and commit the result")


def test_every_rpc_field_and_enum_value_is_commented():
    import re

    declaration = re.compile(r"^\s*(rpc\s|(repeated\s+)?[\w.]+\s+\w+\s*=\s*\d+;|[A-Z0-9_]+\s*=\s*\d+;)")
    undocumented = []
    for path in protogen.PROTO_ROOT.rglob("*.proto"):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if declaration.match(line) and "//" not in line and not lines[number - 1].strip().startswith("//"):
                undocumented.append(f"{path.name}:{number + 1}: {line.strip()}")
    assert not undocumented, "declarations without a comment:\n" + "\n".join(undocumented)
