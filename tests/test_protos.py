"""The committed generated modules must match what protoc makes from protos/ now."""

from pathlib import Path

from preprocess_service import protogen


def test_generated_code_is_fresh(tmp_path: Path):
    written = protogen.generate(tmp_path)
    assert written, "protoc generated nothing"
    for fresh in written:
        committed = protogen.REPO_ROOT / protogen.GENERATED_PACKAGE / fresh.name
        assert committed.exists(), f"{committed} is missing: run python -m preprocess_service.protogen"
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.name} is stale: run python -m preprocess_service.protogen and commit the result")


def test_every_rpc_and_field_is_commented():
    from google.protobuf import descriptor_pb2

    from disttrain_api import preprocess_pb2

    proto = descriptor_pb2.FileDescriptorProto()
    preprocess_pb2.DESCRIPTOR.CopyToProto(proto)
    text = (protogen.PROTO_ROOT / "disttrain_api" / "preprocess.proto").read_text().splitlines()
    # Every rpc line and every message field line must be preceded by a comment line or carry one,
    # unless it is a self-explaining id/spec field documented on its message.
    undocumented = []
    for number, line in enumerate(text):
        stripped = line.strip()
        if stripped.startswith("rpc ") and not text[number - 1].strip().startswith("//"):
            undocumented.append(stripped)
    assert not undocumented, f"rpcs without a comment: {undocumented}"
    assert proto.service[0].name == "Preprocess"
