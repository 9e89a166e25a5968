"""Remote shards against real web servers (nginx, and an http.server that drops connections):
each shard downloaded once per epoch into the bounded cache and re-read locally, the same
samples as from local disk, dropped connections resumed with Range requests, dead shards
reported after bounded retries while the rest is delivered; object stores through fsspec."""

from __future__ import annotations

import json
import os
import sys
import threading

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from disttrain_api.config import JobConfig
from disttrain_api.errors import PermissionDenied
from helpers import shard_keys, write_tiny_shards
from preprocess_service.adapters.decode import InlineDecoder
from preprocess_service.adapters.io import cache as shardcache
from preprocess_service.adapters.io import sources
from preprocess_service.adapters.io.cache import Claim, ShardCache
from preprocess_service.adapters.io.remote import FetchPolicy
from preprocess_service.adapters.io.shards import ShardReader
from preprocess_service.adapters.io.sources import ShardPolicy
from preprocess_service.core.planner import Documents, EpochPlanner
from preprocess_service.service import settings
from preprocess_service.service.job import Job
from webservers import Nginx, Plan, RangeServer, free_port

DECODER = InlineDecoder()
FAST = FetchPolicy(retries=3, backoff_s=0.05, retry_window_s=10)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote") / "data"
    return write_tiny_shards(root, num_shards=4, samples_per_shard=12)


@pytest.fixture(scope="module")
def nginx(data, tmp_path_factory):
    with Nginx(data[0].parent, tmp_path_factory.mktemp("nginx"), slow_rate="96k") as server:
        yield server


def _reader(tmp_path, cache_bytes=64 << 20, **kw) -> ShardReader:
    return ShardReader(cache=ShardCache(cache_bytes, str(tmp_path / "cache")), fetch=kw.pop("fetch", FAST), **kw)


def _config(shards, **kw) -> JobConfig:
    return JobConfig(**{"shards": tuple(shards), "seq_len": 1024, "dp_size": 2, "num_microbatches": 2, "seed": 3,
                        **kw})


def _epoch(job: Job, check=lambda: None) -> list[tuple[list[str], dict[str, np.ndarray]]]:
    """Every microbatch of the job, decoded; ``retain_steps=1`` jobs re-read each one's samples
    from the shards (read_samples), as a server does once a step's bytes were released."""
    out = []
    for step in range(job.plan_all()):
        plan = job.step_plan(step)
        for rank in range(job.config.dp_size):
            for index in range(plan.num_microbatches):
                arrays = job.microbatch(plan, rank, index, DECODER)
                out.append((arrays.sample_keys, arrays.arrays))
                check()
    return out


def _same(got, want) -> None:
    assert [keys for keys, _ in got] == [keys for keys, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def _sizes(paths) -> int:
    return sum(p.stat().st_size for p in paths)


def test_http_shards_give_the_local_samples_and_are_fetched_once_per_epoch(data, nginx, tmp_path):
    urls = [f"{nginx.url}/{p.name}" for p in data]
    local = _epoch(Job(_config(map(str, data)), retain_steps=1))
    reader = _reader(tmp_path)
    start = len(nginx.log())
    cold = _epoch(Job(_config(urls), retain_steps=1, reader=reader))
    _same(cold, local)
    stats = reader.cache.stats()
    assert stats.fetched_bytes == {u: p.stat().st_size for u, p in zip(urls, data)}  # client side: 1.0x exactly
    assert stats.events["miss"] == len(urls) and stats.events["hit"] > len(urls)  # microbatches read the cache
    served = nginx.log_since(start, len(urls))
    assert sorted(line.path for line in served) == sorted(f"/{p.name}" for p in data)  # one GET per shard
    assert sum(line.body_bytes_sent for line in served) == _sizes(data)
    assert sum(line.bytes_sent for line in served) <= 1.05 * _sizes(data)  # with the response headers
    # a second epoch (a new job on the same server) reads the cache: nothing fetched
    warm = _epoch(Job(_config(urls), retain_steps=1, reader=reader))
    _same(warm, local)
    assert reader.cache.stats().fetched_total == _sizes(data) and len(nginx.log_since(start, len(urls))) == len(urls)


def test_a_cache_smaller_than_the_data_stays_in_its_bound_and_refetches_whole_shards(data, nginx, tmp_path):
    urls = [f"{nginx.url}/{p.name}" for p in data]
    bound = max(p.stat().st_size for p in data) * 2 + 1000  # two shards at most
    reader = _reader(tmp_path, cache_bytes=bound)
    peak = [0]

    def check():
        on_disk = sum(f.stat().st_size for f in (tmp_path / "cache").rglob("*") if f.is_file())
        peak[0] = max(peak[0], on_disk)
        assert on_disk <= bound and reader.cache.stats().used_bytes <= bound

    got = _epoch(Job(_config(urls, num_epochs=2, shuffle_buffer=4), retain_steps=1, reader=reader), check)
    want = _epoch(Job(_config(map(str, data), num_epochs=2, shuffle_buffer=4), retain_steps=1))
    _same(got, want)
    stats = reader.cache.stats()
    assert stats.events["eviction"] >= len(urls) and peak[0] > 0
    sizes = {u: p.stat().st_size for u, p in zip(urls, data)}
    assert all(n % sizes[u] == 0 for u, n in stats.fetched_bytes.items())  # whole shards, each read whole
    # a shard larger than the whole cache is streamed, uncached, and still read
    tiny = _reader(tmp_path / "tiny", cache_bytes=1000)
    keys = {s["__key__"] for s in tiny.iter_shard(urls[0], pytest.fail)}
    assert keys == shard_keys(data[:1]) and tiny.cache.stats().events["bypass"] == 1
    assert set(tiny.read_samples(urls[0], {"000000003"})) == {"000000003"}


def test_two_threads_reading_one_url_download_it_once(data, nginx, tmp_path):
    reader = _reader(tmp_path)
    url, start = f"{nginx.url}/slow/{data[0].name}", len(nginx.log())  # slow: the others ask mid-download
    results = []
    threads = [threading.Thread(target=lambda: results.append(reader.read_samples(url, {"000000005"})))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [set(r) for r in results] == [{"000000005"}] * 3
    assert [line.path for line in nginx.log_since(start, 1)] == [f"/slow/{data[0].name}"]
    assert reader.cache.stats().events["miss"] == 1


def test_a_slow_but_progressing_download_is_not_abandoned(data, tmp_path):
    """The server pauses between pieces of the shard: each pause is well within read_timeout_s,
    all of them together (by the server's own sleeps, whatever the machine's speed) longer. The
    download completes in one request and the watchdog never fires."""
    name, pieces, pause = f"/{data[0].name}", 16, 0.1
    server = RangeServer(data[0].parent, Plan(pace={name: (pieces, pause)}))
    try:
        reader = _reader(tmp_path, read_timeout_s=1.0)
        assert (pieces - 1) * pause > reader.read_timeout_s
        problems = []
        keys = {s["__key__"] for s in reader.iter_shard(server.url + name, problems.append)}
        assert not problems and keys == shard_keys(data[:1])  # no read_timeout, nothing lost
        size = data[0].stat().st_size
        assert server.served(1) == [(name, "", 200, size)]  # one request, sent whole
        stats = reader.cache.stats()
        assert stats.fetched_total == size and stats.events["miss"] == 1 and stats.events["retry"] == 0
    finally:
        server.close()


def _claim(cache: ShardCache, url: str, data: bytes, **kw) -> Claim:
    claim = cache.acquire(url, **kw)
    assert isinstance(claim, Claim) and claim.reserve(len(data)) and claim.temp_path is not None
    with open(claim.temp_path, "wb") as f:
        f.write(data)
    return claim


@pytest.mark.parametrize("fault", ["rename", "closed"])
def test_a_commit_that_fails_ends_the_download(data, nginx, tmp_path, monkeypatch, fault):
    """The disk refusing the rename, or the cache closed (its directory removed) mid-download:
    the claim ends, its room is freed, and the next reader of the URL claims it again at once
    (it used to wait wait_timeout_s for a download nobody was making, then fail)."""
    cache, url = ShardCache(1 << 20, str(tmp_path / "cache")), "http://example.org/a.tar"
    claim = _claim(cache, url, b"x" * 100)
    rename = os.rename
    if fault == "rename":
        monkeypatch.setattr(shardcache.os, "rename", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    else:
        cache.close()
    with pytest.raises(OSError):
        claim.commit()
    monkeypatch.setattr(shardcache.os, "rename", rename)
    assert cache.stats().used_bytes == 0 and not os.path.exists(claim.temp_path)
    assert isinstance(cache.acquire(url, wait_timeout_s=0.05), Claim)
    # through a reader: the shard is streamed instead, and the next read caches it
    reader, failed = _reader(tmp_path / "reader"), []

    def rename_once(src, dst):
        if not failed and dst.endswith(".tar"):
            failed.append(dst)
            raise OSError(5, "Input/output error")
        return rename(src, dst)

    monkeypatch.setattr(shardcache.os, "rename", rename_once)
    shard = f"{nginx.url}/{data[0].name}"
    assert {s["__key__"] for s in reader.iter_shard(shard, pytest.fail)} == shard_keys(data[:1])
    assert set(reader.read_samples(shard, {"000000003"})) == {"000000003"}
    events = reader.cache.stats().events
    assert failed and events["bypass"] == 1 and events["miss"] == 2 and reader.cache.stats().shards == 1


def test_a_cache_directory_being_made_is_never_taken_for_a_dead_one(tmp_path, monkeypatch):
    """Another server's cleanup (``_remove_dead_caches``) running while this cache makes its
    directory, between creating the lock file and locking it, must not remove it."""
    parent, real_open = tmp_path / "caches", os.open

    def open_then_cleanup(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if flags & os.O_CREAT and os.path.basename(os.path.dirname(str(path))).startswith(shardcache.DIR_PREFIX):
            shardcache._remove_dead_caches(str(parent))  # a second process: its own open file and flock
        return fd

    monkeypatch.setattr(shardcache.os, "open", open_then_cleanup)
    cache = ShardCache(1 << 20, str(parent))
    claim = _claim(cache, "http://example.org/a.tar", b"x" * 10)
    monkeypatch.setattr(shardcache.os, "open", real_open)
    assert claim.commit() and os.path.isdir(cache.directory)
    shardcache._remove_dead_caches(str(parent))  # alive: kept
    assert os.path.isdir(cache.directory)
    cache.close()
    assert not os.path.exists(cache.directory)


def test_a_download_that_trickles_gives_its_room_in_the_cache_back(data, tmp_path):
    """A server sending a byte now and then keeps the watchdog and the socket timeouts content;
    a download into the cache must also keep up shard_fetch_min_bytes_per_s (after a grace of
    retry_window_s), else it fails and frees the room it reserved (evicting others for it)."""
    name = f"/{data[0].name}"
    server = RangeServer(data[0].parent, Plan(pace={name: (50, 0.05)}))  # 2.5 s by the server's pauses alone
    try:
        fetch = FetchPolicy(retries=3, backoff_s=0.05, retry_window_s=0.3, min_bytes_per_s=1 << 40)
        reader, problems = _reader(tmp_path, fetch=fetch), []
        assert list(reader.iter_shard(server.url + name, problems.append)) == []
        assert [p.kind for p in problems] == ["shard_error"] and "shard_fetch_min_bytes_per_s" in problems[0].reason
        stats = reader.cache.stats()
        assert stats.used_bytes == 0 and stats.shards == 0 and stats.events["failure"] == 1
        assert 0 < stats.fetched_total < data[0].stat().st_size  # given up part way
        claim = reader.cache.acquire(server.url + name, wait_timeout_s=0.05)  # nobody waits for it in vain
        assert isinstance(claim, Claim)
        claim.abandon()
    finally:
        server.close()


def test_one_owner_holds_at_most_its_share_of_the_cache(data, nginx, tmp_path):
    """What one job pins or has reserved is at most owner_share of the cache: beyond, its
    downloads are streamed; others (and it, once it released what it pinned) cache as before."""
    cache = ShardCache(1000, str(tmp_path / "cache"), owner_share=0.5)
    first = _claim(cache, "http://h/1.tar", b"x" * 400, owner="a")
    second = cache.acquire("http://h/2.tar", owner="a")
    assert isinstance(second, Claim) and not second.reserve(200)  # 400 reserved + 200 > 500
    second.abandon()
    third = cache.acquire("http://h/3.tar", owner="b")
    assert isinstance(third, Claim) and third.reserve(400)  # another job's share
    third.abandon()
    first.commit()  # now pinned by "a"
    assert cache.held("a") == 400 and cache.held("b") == 0
    assert isinstance(hit := cache.acquire("http://h/1.tar", owner="b"), str) and hit  # a hit is never refused
    assert cache.held("b") == 400
    cache.release("http://h/1.tar", owner="b")
    again = cache.acquire("http://h/2.tar", owner="a")
    assert isinstance(again, Claim) and not again.reserve(200)
    cache.release("http://h/1.tar", owner="a")
    assert cache.held("a") == 0 and again.reserve(200)  # unpinned: room again
    again.abandon()
    unowned = cache.acquire("http://h/4.tar")
    assert isinstance(unowned, Claim) and unowned.reserve(600)  # no owner: the cache's size alone
    unowned.abandon()
    # through readers: a shard larger than a job's share is streamed for that job, cached otherwise
    size = data[0].stat().st_size
    shared = _reader(tmp_path / "shared", cache_bytes=size * 3 // 2)
    url = f"{nginx.url}/{data[0].name}"
    job = shared.for_owner("job-1")
    assert job.cache is shared.cache and job.owner == "job-1"
    assert {s["__key__"] for s in job.iter_shard(url, pytest.fail)} == shard_keys(data[:1])
    assert shared.cache.stats().events["bypass"] == 1 and shared.cache.stats().shards == 0
    assert {s["__key__"] for s in shared.iter_shard(url, pytest.fail)} == shard_keys(data[:1])
    assert shared.cache.stats().shards == 1 and shared.cache.stats().used_bytes == size


@pytest.mark.parametrize("ignore_ranges", [False, True], ids=["range", "no-range"])
def test_a_connection_dropped_mid_shard_is_resumed(data, tmp_path, ignore_ranges):
    drops = {f"/{p.name}": p.stat().st_size // 2 for p in data}
    server = RangeServer(data[0].parent, Plan(drop_after=dict(drops), ignore_ranges=ignore_ranges,
                                              fail_first={f"/{data[3].name}": 2}))
    try:
        urls = [f"{server.url}/{p.name}" for p in data]
        reader = _reader(tmp_path)
        _same(_epoch(Job(_config(urls), retain_steps=1, reader=reader)),
              _epoch(Job(_config(map(str, data)), retain_steps=1)))
        stats = reader.cache.stats()
        if ignore_ranges:  # read again from the start, what was had dropped
            assert stats.events["restart"] == len(urls) and stats.fetched_total == _sizes(data) + sum(drops.values())
        else:
            assert stats.events["resume"] == len(urls) and stats.fetched_total == _sizes(data)
            assert {(path, rng) for path, rng, status, _ in server.requests if status == 206} == \
                {(path, f"bytes={n}-") for path, n in drops.items()}
        assert stats.events["retry"] == len(urls) + 2 and stats.events["failure"] == 0
    finally:
        server.close()


@pytest.mark.parametrize("cache_bytes", [64 << 20, 0], ids=["cached", "streamed"])
def test_a_planner_resumed_mid_shard_plans_what_the_original_planned(data, nginx, tmp_path, cache_bytes):
    urls = [f"{nginx.url}/{p.name}" for p in data]
    config = _config(urls, shuffle_buffer=5, seqs_per_microbatch=1)
    reader = _reader(tmp_path, cache_bytes=cache_bytes)
    parse = Job(config, reader=reader).documents.parse_only
    skipped = []
    planner = EpochPlanner(config, urls, Documents(reader, parse, skipped.append))
    states, plans = {}, []
    while True:
        states[planner.step] = json.loads(json.dumps(planner.state_dict()))
        plan = planner.next_plan()
        if plan is None:
            break
        plans.append([[d.key for seq in plan.microbatch(r, i) for d in seq.documents]
                      for r in range(2) for i in range(plan.num_microbatches)])
    start = len(nginx.log())
    for step in (1, len(plans) // 2):
        resumed = EpochPlanner(config, urls, Documents(reader, parse, skipped.append))
        resumed.load_state_dict(states[step])
        assert [[[d.key for seq in p.microbatch(r, i) for d in seq.documents] for r in range(2)
                 for i in range(p.num_microbatches)] for p in resumed] == plans[step:]
    assert {e.kind for e in skipped} == {"too_long"}  # one sample's media exceed seq_len: nothing else lost
    ranged = [line.range for line in nginx.log()[start:] if line.range]
    assert bool(ranged) == (cache_bytes == 0)  # a stream starts at the cursor's offset; a cached copy seeks


def test_missing_and_unreachable_shards_are_reported_and_the_rest_delivered(data, nginx, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/gone.tar"  # nobody listens there
    missing = f"{nginx.url}/missing.tar"
    reader = _reader(tmp_path)
    job = Job(_config([f"{nginx.url}/{data[0].name}", missing, dead, f"{nginx.url}/{data[2].name}"]),
              retain_steps=1, reader=reader)
    start = len(nginx.log())
    delivered = [key for keys, _ in _epoch(job) for key in keys]
    assert sorted(delivered) == sorted(shard_keys([data[0], data[2]]))
    reasons = {s.shard: s for s in job.report()["skipped"]}
    assert reasons[missing].kind == "shard_error" and "HTTP 404" in reasons[missing].reason
    assert reasons[dead].kind == "shard_error" and "Connection refused" in reasons[dead].reason
    assert f"after {FAST.retries + 1} attempts" in reasons[dead].reason  # bounded: retries, not a wall time
    assert [line.path for line in nginx.log_since(start, 3) if line.status == 404] == ["/missing.tar"]  # not retried
    assert reader.cache.stats().events["failure"] == 1 and reader.cache.stats().events["retry"] == FAST.retries


def test_sizes_from_the_server_are_bounded(data, nginx, tmp_path):
    reader = _reader(tmp_path, fetch=FetchPolicy(max_shard_bytes=1000))
    problems = []
    assert list(reader.iter_shard(f"{nginx.url}/{data[0].name}", problems.append)) == []
    assert problems[0].kind == "shard_error" and "max_shard_bytes" in problems[0].reason


class _StandInS3(MemoryFileSystem):
    """fsspec's memory filesystem under the s3 protocol: stands in for s3fs (no object store here)."""

    protocol = "s3"
    store: dict = {}
    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("s3://"))


@pytest.fixture()
def fake_s3(data, monkeypatch):
    monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, "s3", _StandInS3)  # restored after the test
    fs = _StandInS3()
    for p in data:
        fs.pipe(f"/bucket/laion/{p.name}", p.read_bytes())
    yield [f"s3://bucket/laion/{p.name}" for p in data]
    _StandInS3.store.clear()


def test_object_store_shards_are_read_through_fsspec_only_when_allowed(data, fake_s3, tmp_path, monkeypatch):
    import fsspec
    import fsspec.core

    monkeypatch.setattr(sys.modules["webdataset.gopen"], "gopen", lambda *a, **k: pytest.fail("gopen runs programs"))
    monkeypatch.setattr(fsspec.core, "url_to_fs", lambda *a, **k: pytest.fail("url_to_fs interprets URL syntax"))
    made, filesystem = [], fsspec.filesystem

    def recorded(protocol, **options):
        made.append((protocol, options))
        return filesystem(protocol, **options)

    monkeypatch.setattr(fsspec, "filesystem", recorded)
    with pytest.raises(PermissionDenied, match="object store"):
        sources.resolve(fake_s3[:1], ShardPolicy())
    reader = _reader(tmp_path, policy=ShardPolicy(allowed_schemes=("file", "s3"),
                                                  allowed_prefixes=("s3://bucket/laion/",)))
    assert reader.expand(["s3://BUCKET/laion/{00000..00003}.tar"]) == fake_s3
    _same(_epoch(Job(_config(fake_s3), retain_steps=1, reader=reader)),
          _epoch(Job(_config(map(str, data)), retain_steps=1)))
    assert reader.cache.stats().fetched_bytes == {u: p.stat().st_size for u, p in zip(fake_s3, data)}
    problems = []
    assert list(reader.iter_shard("s3://bucket/laion/nope.tar", problems.append)) == []
    assert problems[0].kind == "shard_error" and "FileNotFoundError" in problems[0].reason
    # the filesystem made for the scheme, with the read timeout for connecting and reading
    timeouts = {"connect_timeout": reader.read_timeout_s, "read_timeout": reader.read_timeout_s}
    assert made and all(m == ("s3", {"config_kwargs": timeouts}) for m in made)


def test_object_store_requests_have_timeouts(monkeypatch):
    """s3fs gets botocore's connect and read timeouts, gcsfs an aiohttp timeout per request (it
    has none by default); what the operator set in fsspec's config wins."""
    from types import SimpleNamespace

    import fsspec.config

    from preprocess_service.adapters.io.remote import store_options

    assert store_options("s3", 7.0) == {"config_kwargs": {"connect_timeout": 7.0, "read_timeout": 7.0}}
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"read_timeout": 99}})
    assert store_options("s3", 7.0) == {"config_kwargs": {"connect_timeout": 7.0, "read_timeout": 99}}
    monkeypatch.setitem(sys.modules, "aiohttp", SimpleNamespace(ClientTimeout=lambda **kw: kw))  # gcsfs's dependency
    assert store_options("gs", 7.0) == {"requests_timeout": {"sock_connect": 7.0, "sock_read": 7.0}}
    monkeypatch.setitem(fsspec.config.conf, "gcs", {"requests_timeout": 30})
    assert store_options("gs", 7.0) == {}


def test_s3_shards_through_s3fs_against_a_local_s3_server(data, tmp_path, monkeypatch):
    """Only where the [remote] extra and moto[server] are installed (not by ./dev.sh: no object
    store can be reached here, and moto's S3 server is the nearest stand-in)."""
    pytest.importorskip("s3fs", reason="s3fs (the [remote] extra) is not installed")
    moto_server = pytest.importorskip("moto.server", reason="moto[server] (a local S3 server) is not installed")
    import s3fs

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{server._port}"
        for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                            "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setitem(sys.modules["fsspec.config"].conf, "s3", {"endpoint_url": endpoint})
        fs = s3fs.S3FileSystem(endpoint_url=endpoint)
        fs.mkdir("bucket")
        for p in data:
            fs.pipe(f"bucket/laion/{p.name}", p.read_bytes())
        urls = [f"s3://bucket/laion/{p.name}" for p in data]
        reader = _reader(tmp_path, policy=ShardPolicy(allowed_schemes=("file", "s3")))
        _same(_epoch(Job(_config(urls), retain_steps=1, reader=reader)),
              _epoch(Job(_config(map(str, data)), retain_steps=1)))
        assert reader.cache.stats().fetched_bytes == {u: p.stat().st_size for u, p in zip(urls, data)}
        problems = []
        assert list(reader.iter_shard("s3://bucket/laion/nope.tar", problems.append)) == []
        assert problems[0].kind == "shard_error" and "nope.tar" in problems[0].reason
    finally:
        server.stop()


def test_the_settings_reach_the_reader(tmp_path):
    from preprocess_service.adapters.io.shards import ShardReader

    cfg = settings.load(environ={"DISTTRAIN_SHARD_CACHE_BYTES": "1048576", "DISTTRAIN_SHARD_FETCH_RETRIES": "2",
                                 "DISTTRAIN_SHARD_CACHE_DIR": str(tmp_path)})
    reader = ShardReader.configured(cfg)
    assert (reader.cache.max_bytes, reader.cache.parent, reader.fetch.retries) == (1 << 20, str(tmp_path), 2)
    with pytest.raises(Exception, match="shard_cache_bytes"):
        settings.load(environ={"DISTTRAIN_SHARD_CACHE_BYTES": "-1"})


def test_a_full_disk_under_the_cache_loses_no_sample_and_leaves_no_partial_file(data, nginx, tmp_path, caplog):
    """The cache's directory on a real tmpfs smaller than the shards, while the cache's own bound
    says there is room: downloads fail mid-write (ENOSPC), every sample still arrives (those shards
    are streamed uncached), no partial file stays, and what fit is served from the cache."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    size = max(p.stat().st_size for p in data) * 3 // 2
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("tmpfs cannot be mounted here")
    try:
        urls = [f"{nginx.url}/{p.name}" for p in data]
        reader = ShardReader(cache=ShardCache(64 << 20, str(disk)), fetch=FAST)
        with caplog.at_level("WARNING", logger="preprocess_service.adapters.io.remote"):
            job = Job(_config(urls), retain_steps=1, reader=reader)
            got = _epoch(job)
            job.close()  # nothing of it holds the disk when it is unmounted
        local = Job(_config(map(str, data)), retain_steps=1)
        _same(got, _epoch(local))
        local.close()
        events = reader.cache.stats().events
        assert events["bypass"] > 0 and events["hit"] > 0, events  # the disk filled; what fit was cached
        said = [r.getMessage() for r in caplog.records if "cannot cache" in r.getMessage()]
        assert len(said) == 1, said  # said once for the outage, not once per download
        assert not [f for f in disk.rglob("*.part")], "a partial download left behind"
        on_disk = sum(f.stat().st_size for f in disk.rglob("*") if f.is_file())
        assert on_disk <= size
    finally:
        if subprocess.run(["umount", str(disk)], check=False).returncode != 0:
            subprocess.run(["umount", "--lazy", str(disk)], check=False)  # busy: detached now, freed when let go
