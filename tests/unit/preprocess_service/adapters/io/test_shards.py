import pytest

from disttrain_api.errors import ConfigError
from helpers import shard_keys, write_tiny_shards
from preprocess_service.adapters.io import shards
from preprocess_service.adapters.io.sources import ShardPolicy


def test_directory_expands_to_its_tars_only(tmp_path):
    paths = write_tiny_shards(tmp_path, num_shards=3, samples_per_shard=2)
    assert shards.expand_shards([str(tmp_path)]) == [str(p) for p in paths]


def test_brace_patterns_expand_like_webdataset(tmp_path):
    write_tiny_shards(tmp_path, num_shards=3, samples_per_shard=2)
    urls = shards.expand_shards([f"{tmp_path}/{{00000..00001}}.tar"])
    assert urls == [f"{tmp_path}/00000.tar", f"{tmp_path}/00001.tar"]


@pytest.mark.parametrize("name", [
    "00001.jpg", "a/b/00001.JPG", "x.tar.gz", "dir.v2/key.1.jpg", "key.", ".hidden", "noext", "a/.b.c",
    "k.__key__", "päth/ke y.json", "a/b/", "./k.txt", "k..txt", "a/b.c/d", ""])
def test_member_names_split_like_webdataset(name):
    from webdataset.tariterators import base_plus_ext

    from preprocess_service.adapters.io.tarstream import split_name

    key, suffix = base_plus_ext(name)
    expected = (None, None) if key is None or suffix.startswith("__") else (key, suffix.lower())
    if name.startswith("__") or "/__" in name:
        expected = (None, None)
    assert split_name(name) == expected


def test_missing_local_shard_is_a_config_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="nope.tar' does not exist"):
        shards.expand_shards([str(tmp_path / "nope.tar")])


@pytest.mark.parametrize("scheme", ["path", "file", "pipe"])
def test_reads_local_file_and_pipe_urls(tmp_path, scheme):
    [path] = write_tiny_shards(tmp_path, num_shards=1, samples_per_shard=5)
    url = {"path": str(path), "file": f"file://{path}", "pipe": f"pipe:cat {path}"}[scheme]
    # pipe: runs a program, so only a reader whose operator enabled it reads it
    reader = shards.ShardReader(policy=ShardPolicy(allowed_schemes=("file", "pipe")))
    [name] = reader.expand([url])
    errors = []
    samples = list(reader.iter_shard(name, errors.append))
    assert {s["__key__"] for s in samples} == shard_keys([path])
    assert not errors
    assert all({"jpg", "txt", "json"} <= set(s) for s in samples)


def test_a_broken_tar_is_reported_not_raised(tmp_path):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"this is not a tar file" * 100)
    errors = []
    assert list(shards.iter_shard(str(bad), errors.append)) == []
    assert errors and errors[0].shard == str(bad) and errors[0].kind == "truncated_shard"


def test_shard_order_is_a_seeded_permutation_per_epoch():
    from preprocess_service.core.mixture import shard_order

    urls = [f"s{i}" for i in range(20)]
    first = shard_order(urls, seed=1, epoch=0, shuffle=True)
    assert first == shard_order(urls, seed=1, epoch=0, shuffle=True) and sorted(first) == sorted(urls)
    assert first != urls and first != shard_order(urls, seed=1, epoch=1, shuffle=True)
    assert shard_order(urls, seed=1, epoch=0, shuffle=False) == urls


def test_a_shard_scheme_is_one_registered_class(tmp_path):
    """Adding a scheme is a Scheme subclass registered by name: the reader opens, reads and re-reads
    by key through it, its names follow the rule it declares, and the operator must still allow it."""
    import io
    from contextlib import contextmanager

    from disttrain_api.errors import PermissionDenied
    from preprocess_service.adapters.io import schemes, sources
    from preprocess_service.adapters.io.remote import Opened

    paths = write_tiny_shards(tmp_path, num_shards=1, samples_per_shard=5)
    blobs = {"bucket/a.tar": paths[0].read_bytes()}

    class InMemory(schemes.Scheme):
        names = ("memtest",)
        naming = "url"

        @contextmanager
        def open(self, reader, source, progress, start=0):
            f = io.BytesIO(blobs[source.location.split("://", 1)[1]])
            f.seek(start)
            yield Opened(f, None)

    schemes.register(InMemory)
    try:
        reader = shards.ShardReader(policy=ShardPolicy(allowed_schemes=("file", "memtest")))
        [url] = reader.expand(["MEMTEST://Bucket/a.tar"])
        assert url == "memtest://bucket/a.tar"  # the url naming rule: scheme and host lower-cased
        problems = []
        samples = list(reader.iter_shard(url, problems.append))
        assert [s["__key__"] for s in samples] == sorted(shard_keys(paths)) and not problems
        again = reader.read_samples(url, {samples[2]["__key__"]})
        assert again[samples[2]["__key__"]]["txt"] == samples[2]["txt"]
        with pytest.raises(PermissionDenied, match="memtest"):
            shards.ShardReader().expand([url])
        with pytest.raises(ValueError, match="two shard schemes"):
            schemes.register(InMemory)
    finally:
        schemes.SCHEMES.pop("memtest", None)
        sources.NAMING.pop("memtest", None)


def _tar(entries: list[tuple[str, bytes]]) -> bytes:
    import io
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize("cut", [None, *range(300, 9000, 331)])  # cut in headers, members and padding
def test_keys_from_headers_are_the_keys_a_full_read_yields(tmp_path, cut):
    """ShardReader.shard_keys (a restore's duplicate-key hashes) skips members' bytes but decides
    by the same headers: repeated keys, duplicate members, oversize and bad keys, a cut tail."""
    limits = shards.TarLimits(max_member_bytes=300)
    body = _tar([("a.txt", b"x" * 10), ("a.jpg", b"j" * 20), ("b.txt", b"y" * 500),  # b: oversize
                 ("c.txt", b"1"), ("c.txt", b"2"), ("a.txt", b"again"),  # a duplicate member, a key again
                 ("d.txt", b"z" * 100), (("k" * 1100) + ".txt", b"long key"), ("e.txt", b"e" * 50)])
    path = tmp_path / "s.tar"
    path.write_bytes(body if cut is None else body[:cut])
    reader = shards.ShardReader(limits=limits)
    full = [s["__key__"] for s in reader.iter_shard(str(path), lambda problem: None)]
    assert list(reader.shard_keys(str(path))) == full
    assert list(reader.shard_keys(str(path), 2)) == full[:2]
    if cut is None:
        assert full == ["a", "c", "d", "e"]
