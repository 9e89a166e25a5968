"""Adversarial shard sources: many variants of each class (program schemes, traversal, prefix
escapes, brace bombs, oversized specs, non-regular files, hostile HTTP), each refused with the
right error, nothing executed, and good shards beside a bad one still delivered exactly once."""

from __future__ import annotations

import http.server
import itertools
import os
import socket
import threading
import time
import tracemalloc

import grpc
import pytest

from disttrain_api.config import JobConfig
from disttrain_api.errors import ConfigError, PermissionDenied
from helpers import shard_keys, write_tiny_shards
from preprocess_service.adapters.io import sources
from preprocess_service.adapters.io.shards import ShardReader
from preprocess_service.adapters.io.sources import ShardPolicy
from preprocess_service.service.server import create_server
from preprocess_service.service.settings import ServiceSettings
from trainer import DataClient

PROGRAM_SCHEMES = ["pipe", "PIPE", "Pipe", "gs", "s3", "ais", "sftp", "scp", "hf", "htgs", "gsutil", "ftp",
                   "javascript", "data", "x-custom"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("attack-sources")
    allowed = root / "allowed"
    paths = write_tiny_shards(allowed, num_shards=2, samples_per_shard=6)
    outside = root / "outside"
    write_tiny_shards(outside, num_shards=1, samples_per_shard=2)
    (allowed / "escape").symlink_to(outside, target_is_directory=True)
    (allowed / "escape.tar").symlink_to(outside / "00000.tar")
    return root, allowed, outside, paths


def _program_variants(marker) -> list[str]:
    commands = [f"touch {marker}", f"sh -c 'touch {marker}'", f"touch {marker}; cat /dev/null", f"$(touch {marker})"]
    out = []
    for scheme, command in itertools.product(PROGRAM_SCHEMES, commands):
        body = f"{scheme}:{command}"
        out += [body, f"X::{body}", f"{{{body},y}}", f"{body}; cat /../..{marker.parent}"]
    return out


def test_program_schemes_are_refused_and_never_run(data, tmp_path):
    root, allowed, *_ = data
    marker = tmp_path / "ran"
    policies = [ShardPolicy(), ShardPolicy(allowed_prefixes=(str(allowed),))]
    variants = _program_variants(marker)
    assert len(variants) >= 200
    for policy, spec in itertools.product(policies, variants):
        with pytest.raises((PermissionDenied, ConfigError)) as info:
            sources.resolve([spec], policy)
        assert spec[:20] in str(info.value) or "shard" in str(info.value)
    assert not marker.exists()


def test_pipe_runs_only_when_the_operator_enables_it(data, tmp_path):
    _, allowed, _, paths = data
    policy = ShardPolicy(allowed_schemes=("file", "pipe"))
    [name] = ShardReader(policy=policy).expand([f"pipe:cat {paths[0]}"])
    samples = list(ShardReader(policy=policy).iter_shard(name, lambda p: None))
    assert {s["__key__"] for s in samples} == shard_keys([paths[0]])
    # a plan (or a Redis record) naming a pipe is checked again when the shard is opened
    marker = tmp_path / "ran"
    problems = []
    assert list(ShardReader().iter_shard(f"pipe:touch {marker}", problems.append)) == []
    assert "allowed_shard_schemes" in problems[0].reason and not marker.exists()


def _traversal_variants(allowed) -> list[str]:
    base = str(allowed)
    tails = ["..", "../", "../outside/00000.tar", "a/../../outside", "./../outside", "..//outside",
             "{..,x}/00000.tar", "{x,..}/outside", "{0..1}/../x", "..\\outside", "a/..\\..\\b"]
    out = []
    for tail in tails:
        out += [f"{base}/{tail}", f"file:{base}/{tail}", f"file://{base}/{tail}", f"X::{base}/{tail}"]
    out += ["../etc/passwd", "..", "file:..", "http://host/../x", "http://host/a/%2e%2e/x", "http://host/%2E%2E/x",
            "https://host/a/..%2fb", "http://host/a/%2e%2e%2fb", "s3://b/../k"]
    return out


def test_traversal_is_refused_before_any_prefix_check(data):
    _, allowed, *_ = data
    variants = _traversal_variants(allowed)
    assert len(variants) >= 50
    for spec in variants:
        for policy in (ShardPolicy(), ShardPolicy(allowed_prefixes=(str(allowed),))):
            with pytest.raises((ConfigError, PermissionDenied)) as info:
                sources.resolve([spec], policy)
            assert "'..'" in str(info.value) or "allowed_shard" in str(info.value), spec


def test_prefix_escapes_through_symlinks_names_and_schemes(data):
    root, allowed, outside, _ = data
    policy = ShardPolicy(allowed_prefixes=(str(allowed), "https://data.example.com/laion/"))
    escapes = [str(allowed / "escape" / "00000.tar"), str(allowed / "escape.tar"), str(allowed / "escape"),
               str(outside), str(allowed) + "x", f"{allowed}{{x,y}}", "/etc/passwd", "file:///etc/passwd",
               "::/etc/passwd", f"{allowed}/00000.tar::/etc/passwd", "https://data.example.com/laionX/0.tar",
               "https://data.example.com/other/0.tar", "http://data.example.com/laion/0.tar",
               "https://data.example.com.evil.net/laion/0.tar", "https://user@evil.net/laion/0.tar",
               "https://evil.net/data.example.com/laion/0.tar"]
    for spec in escapes:
        with pytest.raises((PermissionDenied, ConfigError)) as info:
            sources.resolve([spec], policy)
        assert "shard" in str(info.value), spec
    assert [s.url for s in sources.resolve([str(allowed / "00000.tar")], policy)] == [str(allowed / "00000.tar")]
    assert sources.resolve(["https://DATA.example.com/laion/0.tar"], policy)[0].url == \
        "https://data.example.com/laion/0.tar"


def test_a_name_holding_fsspec_chain_syntax_is_refused(data, monkeypatch):
    """``::`` chains filesystems in fsspec (``s3://bucket/key::file:///etc/passwd`` would pass an
    ``s3://bucket/`` prefix and read a local file): refused in every parsed name of a remote or
    program scheme, whether it comes from a spec (split on ``::`` first, each part checked) or
    from a plan record (read by name); fsspec is never asked to interpret a name."""
    import fsspec
    import fsspec.core

    monkeypatch.setattr(fsspec.core, "url_to_fs", lambda *a, **k: pytest.fail("url_to_fs interprets '::'"))
    monkeypatch.setattr(fsspec, "filesystem", lambda *a, **k: pytest.fail("a chained name reached fsspec"))
    names = ["s3://bucket/key::file:///etc/passwd", "gs://bucket/a.tar::file:///etc/passwd",
             "s3://bucket/k::simplecache::file:///etc/passwd", "s3://bucket/x::", "gs://bucket/::x",
             "http://data.example.com/a.tar::file:///etc/passwd", "https://h/a?x=::", "https://u::p@h/a.tar",
             "pipe:cat a::b", "x-custom:a::b"]
    for name in names:
        with pytest.raises(ConfigError, match="'::'"):
            sources.parse(name)
    policy = ShardPolicy(allowed_schemes=("file", "http", "https", "s3", "gs"),
                         allowed_prefixes=("s3://bucket/", "gs://bucket/", "http://data.example.com/"))
    for spec in names[:3]:  # a spec's '::' separates shards: the local file is then checked as such
        with pytest.raises(PermissionDenied, match="allowed_shard_prefixes"):
            sources.resolve([spec], policy)
    reader = ShardReader(policy=policy)
    for name in names[:2]:
        problems = []
        assert list(reader.iter_shard(name, problems.append)) == [] and "'::'" in problems[0].reason
    for name in ["s3://bucket/k?versionId=1", "s3://user@bucket/k", "s3://bucket:9000/k"]:
        with pytest.raises(ConfigError, match="bucket/key"):
            sources.parse(name)
    # an IPv6 host is still an IPv6 host
    assert sources.parse("http://[::1]:8080/a.tar").location == "http://[::1]:8080/a.tar"


def test_brace_patterns_are_counted_before_they_are_expanded(data):
    _, allowed, *_ = data
    policy = ShardPolicy(max_shards=1000)
    bombs = ["x{0..999999999}", "x{0..999999999999999999999}", "{0..99}{0..99}", "{a,b}" * 11,
             "{" * 20 + "a" + "}" * 20, "x{0..10000..1}", f"{allowed}/{{0..9}}{{0..9}}{{0..9}}{{0..9}}",
             "{a,b,c,d,e,f,g,h,i,j}{0..9}{0..9}{0..9}", "x{1..5}::" * 300 + "y"]
    for spec in bombs:
        tracemalloc.start()
        try:
            with pytest.raises(ConfigError) as info:
                sources.resolve([spec], policy)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, (spec, peak)  # refused before anything big is built (a count, not a wall time)
        assert "max_shards" in str(info.value) or "brace" in str(info.value) or "characters" in str(info.value) \
            or "unmatched" in str(info.value), (spec, info.value)
    for spec in ["x{", "x}", "{a,b", "a{1..}", "x{1..3..0}", "", "\x00", "a\nb", "x" * 5000]:
        with pytest.raises(ConfigError):
            sources.resolve([spec], policy)
    with pytest.raises(ConfigError, match="at most"):
        sources.resolve(["x"] * 5000, policy)


def test_the_expander_agrees_with_webdatasets_on_ordinary_patterns():
    import braceexpand

    for pattern in ["a{0..3}b", "x{000..010}.tar", "{a,b{1..2},c}/d", "s{0..10..3}", "s{10..0..3}", "{a..e}",
                    "plain", "{a,{b,c}}{1,2}", "x{00..99}y{0..1}", "a{-2..2}"]:
        assert sources.expand(pattern, 10_000) == list(braceexpand.braceexpand(pattern)), pattern


@pytest.fixture()
def server_for(data):
    servers = []

    def start(**limits):
        server, port, _ = create_server("127.0.0.1:0", decode_workers=0, settings=ServiceSettings(**limits))
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0).wait()


def _config(*specs, **kw):
    fields = dict(shards=specs, seq_len=2048, dp_size=1, num_microbatches=2, seqs_per_microbatch=1, shuffle_buffer=1)
    fields.update(kw)
    return JobConfig(**fields)


def test_refusals_reach_the_client_with_the_right_code(data, server_for, tmp_path):
    _, allowed, *_ = data
    address = server_for(allowed_shard_prefixes=(str(allowed),), max_shards=100)
    marker = tmp_path / "ran"
    cases = [(f"pipe:touch {marker}", grpc.StatusCode.PERMISSION_DENIED, "allowed_shard_schemes"),
             (f"X::pipe:touch {marker}", grpc.StatusCode.PERMISSION_DENIED, "pipe"),
             (f"{allowed}/../outside", grpc.StatusCode.INVALID_ARGUMENT, "'..'"),
             ("/etc/passwd", grpc.StatusCode.PERMISSION_DENIED, "allowed_shard_prefixes"),
             (f"{allowed}/{{0..999999}}.tar", grpc.StatusCode.INVALID_ARGUMENT, "max_shards"),
             (f"{allowed}/nope.tar", grpc.StatusCode.INVALID_ARGUMENT, "does not exist")]
    for spec, code, words in cases:
        with pytest.raises(grpc.RpcError) as info:
            DataClient(address, _config(spec), 0, connect_timeout_s=5)
        assert info.value.code() == code, spec
        assert words in info.value.details() and "shard" in info.value.details(), info.value.details()
    assert not marker.exists()


def _consume(address, config, before=lambda: None):
    keys = []
    with DataClient(address, config, 0, connect_timeout_s=5) as client:
        before()  # the job is open, nothing is planned yet
        for mb in client:
            keys += mb.sample_keys
        report = client.report()
    return keys, report


def test_a_fifo_a_device_and_a_swapped_file_fail_their_shard_only(data, server_for, tmp_path):
    _, allowed, _, paths = data
    fifo = tmp_path / "stuck.tar"
    os.mkfifo(fifo)
    swapped = tmp_path / "swapped.tar"
    swapped.write_bytes(paths[0].read_bytes())

    def swap_for_a_fifo():  # regular when the job was opened, a FIFO when it is read
        swapped.unlink()
        os.mkfifo(swapped)

    address = server_for(shard_read_timeout_s=5, plan_ahead=False)  # no shard is read before the swap
    keys, report = _consume(address, _config(str(paths[0]), str(fifo), "/dev/zero", str(swapped), str(paths[1])),
                            before=swap_for_a_fifo)
    assert sorted(keys) == sorted(shard_keys(paths))
    # refused for what they are when opened: a read that waited for a FIFO's writer would have
    # ended in read_timeout ("no data for 5 s") instead
    reasons = {s.shard: s for s in report.skipped}
    assert "FIFO" in reasons[str(fifo)].reason and "FIFO" in reasons[str(swapped)].reason
    assert "device" in reasons["/dev/zero"].reason
    assert not any(s.kind == "read_timeout" for s in report.skipped)


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict = {}

    def do_GET(self):  # the stdlib's name
        action = self.routes.get(self.path)
        if action is None:
            self.send_error(404)
        else:
            action(self)

    def log_message(self, *args):
        pass


@pytest.fixture()
def web(data):
    _, _, _, paths = data
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    port = server.server_address[1]

    def serve_file(handler, path=paths[1]):
        body = path.read_bytes()
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def stall(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", "10000000")
        handler.end_headers()
        handler.wfile.write(paths[1].read_bytes()[:700])  # a header and a little, then nothing
        handler.wfile.flush()
        time.sleep(30)

    def redirect(target):
        def go(handler):
            handler.send_response(302)
            handler.send_header("Location", target)
            handler.end_headers()
        return go

    _Handler.routes = {"/good.tar": serve_file, "/stall.tar": stall,
                       "/to-file.tar": redirect(f"file://{paths[0]}"),
                       "/to-other.tar": redirect("http://127.0.0.2:9/x.tar"),
                       "/to-good.tar": redirect(f"http://127.0.0.1:{port}/good.tar")}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    server.shutdown()


def test_http_shards_stalls_and_redirects_outside_the_policy(data, server_for, web):
    _, allowed, _, paths = data
    address = server_for(allowed_shard_prefixes=(str(allowed), web + "/"), shard_read_timeout_s=3)
    specs = [str(paths[0]), f"{web}/stall.tar", f"{web}/to-file.tar", f"{web}/to-other.tar", f"{web}/to-good.tar",
             f"{web}/missing.tar"]
    keys, report = _consume(address, _config(*specs))
    # shard 0 from disk and shard 1 through the allowed redirect; nothing through the refused ones
    assert sorted(keys) == sorted(shard_keys(paths))
    by_shard = {s.shard: s for s in report.skipped}
    assert "Redirection to url 'file:" in by_shard[f"{web}/to-file.tar"].reason  # urllib: never to file:
    assert "redirect refused" in by_shard[f"{web}/to-other.tar"].reason
    assert "404" in by_shard[f"{web}/missing.tar"].reason
    stalled = [s for s in report.skipped if s.shard == f"{web}/stall.tar"]
    assert stalled and stalled[0].kind in ("read_timeout", "truncated_shard"), stalled


def test_a_socket_named_like_a_shard_is_not_read(tmp_path):
    path = tmp_path / "sock.tar"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    problems = []
    assert list(ShardReader().iter_shard(str(path), problems.append)) == []
    assert "socket" in problems[0].reason
    sock.close()
