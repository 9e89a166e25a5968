"""TLS, mutual TLS, token authentication and per-client limits, against a real server on loopback."""

from __future__ import annotations

import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disttrain_api.config import JobConfig
from disttrain_api.errors import ServiceUnavailableError
from helpers import write_tiny_shards
from preprocess_service.service.security import TlsFiles
from preprocess_service.service.server import create_server
from preprocess_service.service.settings import ServiceSettings
from trainer import Credentials, DataClient

TOKEN = "s3cret-token-for-tests"


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(directory, name):
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=directory)


def _signed(directory, name, ca, san=None):
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=directory)
    (directory / f"{name}.ext").write_text(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=directory)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1, a client certificate, and a client certificate
    from another CA."""
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _signed(d, "server", "ca", san="IP:127.0.0.1,DNS:localhost")
    _signed(d, "client", "ca")
    _signed(d, "rogue", "rogue-ca")
    return d


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("security-shards")
    write_tiny_shards(root, num_shards=1, samples_per_shard=12)
    return root


def _config(root, **kw):
    fields = dict(shards=(str(root),), seq_len=2048, dp_size=1, num_microbatches=1, seqs_per_microbatch=1)
    fields.update(kw)
    return JobConfig(**fields)


@pytest.fixture(scope="module")
def secure_server(pki):
    server, port, _ = create_server("127.0.0.1:0", decode_workers=0, auth_tokens=(TOKEN, "second-token"),
                                    tls=TlsFiles(pki / "server.pem", pki / "server.key", client_ca=pki / "ca.pem"))
    yield f"127.0.0.1:{port}"
    server.stop(0).wait()


def _creds(pki, token=TOKEN, cert="client"):
    return Credentials(token=token, tls_ca=str(pki / "ca.pem"), tls_cert=str(pki / f"{cert}.pem") if cert else None,
                       tls_key=str(pki / f"{cert}.key") if cert else None)


def test_mutual_tls_and_a_token_stream_microbatches(secure_server, pki, shards):
    with DataClient(secure_server, _config(shards), 0, credentials=_creds(pki), connect_timeout_s=5) as client:
        mb = next(client)
        assert mb.step == 0 and mb.tokens.numel() > 0


@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["no-token", "wrong-token"])
def test_calls_without_a_valid_token_get_unauthenticated(secure_server, pki, shards, token):
    with pytest.raises(grpc.RpcError) as info:
        DataClient(secure_server, _config(shards), 0, credentials=_creds(pki, token=token), connect_timeout_s=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "bearer token" in info.value.details()


def test_a_stream_without_a_token_is_refused_too(secure_server, pki, shards):
    with DataClient(secure_server, _config(shards), 0, credentials=_creds(pki), connect_timeout_s=5) as client:
        job_id = client.job_id
    creds = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes(), (pki / "client.key").read_bytes(),
                                         (pki / "client.pem").read_bytes())
    from disttrain_api import preprocess_pb2 as pb
    from disttrain_api import preprocess_pb2_grpc as pb_grpc

    with grpc.secure_channel(secure_server, creds) as channel:
        stream = pb_grpc.PreprocessStub(channel).StreamMicrobatches(pb.StreamRequest(job_id=job_id, dp_rank=0))
        with pytest.raises(grpc.RpcError) as info:
            next(stream)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # health checks stay open to probes, which send no token
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("cert", [None, "rogue"], ids=["no-client-certificate", "certificate-of-another-ca"])
def test_mutual_tls_refuses_clients_without_a_certificate_from_the_ca(secure_server, pki, shards, cert):
    with pytest.raises(ServiceUnavailableError, match="cannot reach"):
        DataClient(secure_server, _config(shards), 0, credentials=_creds(pki, cert=cert), connect_timeout_s=2)


def test_a_plaintext_client_cannot_talk_to_a_tls_server(secure_server, shards):
    with pytest.raises(ServiceUnavailableError):
        DataClient(secure_server, _config(shards), 0, credentials=Credentials(token=TOKEN), connect_timeout_s=2)


def test_token_only_server_and_credentials_from_the_environment(shards, monkeypatch):
    server, port, _ = create_server("127.0.0.1:0", decode_workers=0, auth_tokens=(TOKEN,))
    try:
        monkeypatch.setenv("DISTTRAIN_AUTH_TOKEN", TOKEN)
        with DataClient(f"127.0.0.1:{port}", _config(shards), 0) as client:
            assert next(client).step == 0
        monkeypatch.delenv("DISTTRAIN_AUTH_TOKEN")
        with pytest.raises(grpc.RpcError) as info:
            DataClient(f"127.0.0.1:{port}", _config(shards), 0)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0).wait()


def test_limits_streams_per_client_open_jobs_request_size_and_shard_prefixes(shards, tmp_path):
    limits = ServiceSettings(max_streams_per_client=1, max_open_jobs=1, max_request_bytes=64 << 10,
                    allowed_shard_prefixes=(str(shards),))
    server, port, servicer = create_server("127.0.0.1:0", decode_workers=0, settings=limits)
    address = f"127.0.0.1:{port}"
    try:
        first = DataClient(address, _config(shards, num_epochs=1000), 0, prefetch=1)
        next(first)  # its stream is open (and far from its end)
        second = DataClient(address, first.job_id, 0, prefetch=1, reconnect_timeout_s=1)  # the same job
        with pytest.raises(ServiceUnavailableError, match="RESOURCE_EXHAUSTED.*max_streams_per_client"):
            next(second)
        second.close()
        with pytest.raises(grpc.RpcError) as info:  # a second job
            DataClient(address, _config(shards, seed=1), 0)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_open_jobs" in info.value.details()
        first.close()
        outside = tmp_path / "elsewhere"
        write_tiny_shards(outside, num_shards=1, samples_per_shard=2)
        for spec in (str(outside), "https://example.com/x.tar"):
            with pytest.raises(grpc.RpcError) as info:
                DataClient(address, _config(shards, shards=(spec,)), 0)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, spec
            assert "allowed_shard_prefixes" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:  # '..' is refused outright, before any prefix check
            DataClient(address, _config(shards, shards=(f"{shards}/../{outside.name}",)), 0)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'..'" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:  # a 100 KB request
            DataClient(address, _config(shards, shards=(str(shards) + "/" + "x" * 100_000,)), 0)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # the service still serves after all of that
        with DataClient(address, first.job_id, 0) as client:
            assert next(client).step == 0
    finally:
        server.stop(0).wait()
