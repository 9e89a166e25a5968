"""Resolving many names resolves each folder once and each file's own link: the same paths as
realpath, and a file linked out of the allowed prefixes is still refused."""

import os
import tracemalloc

import braceexpand
import pytest

from disttrain_api.errors import ConfigError, PermissionDenied
from preprocess_service.adapters.io import sources
from preprocess_service.adapters.io.sources import ShardPolicy, resolve


def test_names_resolve_as_realpath_does_through_folder_and_file_links(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(5):
        (data / f"{i:03d}.tar").write_bytes(b"")
    os.symlink(data, tmp_path / "alias")  # a linked folder
    os.symlink(data / "001.tar", data / "005.tar")  # a linked file inside it
    policy = ShardPolicy(allowed_prefixes=(str(tmp_path),))
    names = [str(tmp_path / "alias" / f"{i:03d}.tar") for i in range(6)]
    got = [s.location for s in resolve([str(tmp_path / "alias" / "{000..005}.tar")], policy)]
    assert got == [os.path.realpath(n) for n in names]
    assert got[5] == str(data / "001.tar")


def test_a_file_linked_out_of_the_allowed_prefix_is_refused(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (outside / "secret.tar").write_bytes(b"")
    (allowed / "000.tar").write_bytes(b"")
    os.symlink(outside / "secret.tar", allowed / "001.tar")
    policy = ShardPolicy(allowed_prefixes=(str(allowed),))
    assert len(resolve([str(allowed / "000.tar")], policy)) == 1
    with pytest.raises(PermissionDenied, match="outside the prefixes"):
        resolve([str(allowed / "{000..001}.tar")], policy)
    with pytest.raises(PermissionDenied, match="outside the prefixes"):
        resolve([str(allowed)], policy)  # the folder's *.tar files, one of them a link out


# --- names held lazily --------------------------------------------------------------------------

PATTERNS = ["https://h.example/{a,b{0..3},c{x,y}{00..11..3}}/{0..60..7}.tar",
            "https://h.example/z{10..-5..4}/{A..F}{,_{1..2}}.tar",
            "https://h.example/{{{1,2},3},{4..6}}x{009..011}.tar::https://h.example/tail/{0..2}.tar",
            "HTTPS://H.Example/{0..9}/{0..9}.tar"]  # names normalised away from their spelling


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_held_lazily_names_what_the_eager_expansion_names(pattern, monkeypatch):
    policy = ShardPolicy(allowed_schemes=("https",))
    eager = list(sources.resolve_names([pattern], policy))
    monkeypatch.setattr(sources, "EAGER_NAMES", 2)  # every part held as its pattern
    lazy = sources.resolve_names([pattern], policy)
    assert any(isinstance(p, sources.PatternNames) for p in getattr(lazy, "parts", [lazy]))
    assert lazy == eager and [lazy[i] for i in range(len(lazy) - 1, -1, -1)] == eager[::-1]
    assert eager == [sources.parse(n).url for part in pattern.split("::") for n in braceexpand.braceexpand(part)]
    assert all(lazy.position(url) == eager.index(url) for url in eager)


def test_a_million_names_cost_no_memory_until_asked_for():
    policy = ShardPolicy(allowed_schemes=("https",), max_shards=1_000_000)
    tracemalloc.start()
    try:
        names = sources.resolve_names(["https://data.example/laion/{000000..999999}.tar"], policy)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(names) == 1_000_000 and held < 1_000_000  # vs ~100 MB as a list of strings
    assert names[123_456] == "https://data.example/laion/123456.tar" and names[-1].endswith("/999999.tar")
    with pytest.raises(ConfigError, match="max_shards"):
        sources.resolve_names(["https://data.example/{0..999999}.tar::https://data.example/x.tar"], policy)


def test_a_lazy_name_is_checked_when_made(tmp_path, monkeypatch):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for i in (0, 4999, 9999):
        (allowed / f"{i:04d}.tar").write_bytes(b"")
    policy = ShardPolicy(allowed_prefixes=(str(allowed),))
    monkeypatch.setattr(sources, "EAGER_NAMES", 100)
    monkeypatch.setattr(sources, "SPOT_CHECKS", 2)  # first and last only
    hidden = f"{{{allowed}/{{0000..4999}}.tar,{tmp_path}/outside/x.tar,{allowed}/{{5000..9999}}.tar}}"
    names = sources.resolve_names([hidden], policy)
    assert len(names) == 10_001 and names[4999] == str(allowed / "4999.tar")
    with pytest.raises(PermissionDenied, match="outside the prefixes"):
        names[5000]  # never a name the policy refuses, however far in the pattern
    monkeypatch.setattr(sources, "SPOT_CHECKS", 64)
    with pytest.raises(PermissionDenied, match="outside the prefixes"):  # spread checks see a half
        sources.resolve_names([f"{{{allowed},{tmp_path}/out}}/{{0000..4999}}.tar"], policy)
    with pytest.raises(ConfigError, match="does not exist"):  # a typo is refused, not a million errors
        sources.resolve_names([f"{allowed}/{{00000..09999}}.tar"], policy)


def test_a_folder_is_held_as_one_string_and_its_links_resolved(tmp_path):
    data, outside = tmp_path / "data", tmp_path / "outside"
    data.mkdir()
    outside.mkdir()
    for i in range(3000):
        (data / f"{i:05d}.tar").write_bytes(b"")
    (outside / "o.tar").write_bytes(b"")
    os.symlink(outside / "o.tar", data / "zz.tar")
    names = sources.resolve_names([str(data)], ShardPolicy())
    assert isinstance(names, sources.FolderNames) and len(names) == 3001
    assert list(names) == sorted(str(data / n) for n in os.listdir(data) if n != "zz.tar") + [str(outside / "o.tar")]
    assert names.position(str(data / "01234.tar")) == 1234
    assert len(names._blob) == 3000 * 10 + 7  # one string, not 3,001 objects


def test_a_file_in_a_format_not_read_is_refused_naming_it_and_the_formats_read(tmp_path):
    import gzip

    import webdataset as wds

    with wds.TarWriter(str(tmp_path / "ok.tar")) as writer:
        writer.write({"__key__": "a", "txt": b"x"})
    (tmp_path / "ok.tar.gz").write_bytes(gzip.compress((tmp_path / "ok.tar").read_bytes()))
    (tmp_path / "empty.tar").write_bytes(b"")  # nothing to tell: the reader reports it
    assert len(resolve([str(tmp_path / "ok.tar"), str(tmp_path / "ok.tar.gz"), str(tmp_path / "empty.tar")])) == 3
    foreign = {"llava.bin": (b'[{"id": "1", "image": "a.jpg", "conversations": []}]', "JSON"),
               "train.tar": (b"PAR1" + bytes(600), "a Parquet file"),
               "notes.txt": (b"just some words\n" * 40, "text"),
               "photo.tar": (b"\xff\xd8\xff\xe0" + bytes(600), "a JPEG image"),
               "x.tar.zst": (b"\x28\xb5\x2f\xfd" + bytes(600), "zstd-compressed")}
    (tmp_path / "noise.tar").write_bytes(bytes(range(256)) * 3)  # damaged, not foreign: the reader reports it
    assert len(resolve([str(tmp_path / "noise.tar")])) == 1
    for name, (data, kind) in foreign.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match=f"{name}' is {kind}.*not a format this service reads: WebDataset tar"):
            resolve([str(tmp_path / name)])
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "llava.json").write_bytes(foreign["llava.bin"][0])  # named by itself, not by its folder
    with pytest.raises(ConfigError, match="holds no .*tar or .*parquet file; this service reads WebDataset tar"):
        resolve([str(tmp_path / "sub")])
