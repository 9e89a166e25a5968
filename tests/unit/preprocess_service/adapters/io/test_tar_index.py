"""The tar index read by pread (plain ustar and pax headers) equals tarfile's, whatever the tar holds;
and any header it does not read itself hands the whole tar to tarfile."""

import io
import tarfile

import pytest
import webdataset as wds

from preprocess_service.adapters.io import tarstream
from preprocess_service.adapters.io.tarstream import TarLimits

LIMITS = TarLimits(max_member_bytes=3000)


def _add(tar: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, **extra) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.type = len(data), kind
    for field, value in extra.items():
        setattr(info, field, value)
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def _tarfile_made(path, fmt, names):
    with tarfile.open(path, "w", format=fmt) as tar:
        for i, name in enumerate(names):
            _add(tar, name, bytes([i % 256]) * (100 * i + 1))
        _add(tar, "dir/", kind=tarfile.DIRTYPE)
        _add(tar, "link.jpg", kind=tarfile.SYMTYPE, linkname="0.jpg")


NAMES = ["a.jpg", "a.txt", "b.jpg", "b.json", "a.jpg", "c.big.txt", "d/e.f.png", "__meta__/x.txt", "g.txt",
         "big.jpg"]


def _writers():
    def webdataset_writer(path):  # pax headers with a fractional mtime before every member
        with wds.TarWriter(str(path)) as writer:
            for i in range(5):
                writer.write({"__key__": f"{i:04d}", "jpg": bytes(300 * i + 7), "txt": b"caption", "json": b"{}"})

    def long_and_unicode(fmt):
        names = [*NAMES, "x" * 140 + ".jpg", "p" * 120 + "/q.txt", "caf\u00e9.jpg", "\u00fcber.txt"]
        return lambda path: _tarfile_made(path, fmt, names)

    def oversize(path):  # a member over max_member_bytes is left out of its sample
        _tarfile_made(path, tarfile.USTAR_FORMAT, ["k.jpg", "k.txt"] + [f"k{i}.txt" for i in range(40)])

    return {"webdataset": webdataset_writer, "ustar": lambda p: _tarfile_made(p, tarfile.USTAR_FORMAT, NAMES),
            "pax": long_and_unicode(tarfile.PAX_FORMAT), "gnu": long_and_unicode(tarfile.GNU_FORMAT),
            "oversize": oversize}


@pytest.mark.parametrize("writer", list(_writers()))
@pytest.mark.parametrize("damage", ["none", "cut_in_data", "cut_in_header", "bad_checksum", "garbage_tail"])
def test_the_pread_index_equals_tarfiles(tmp_path, writer, damage):
    path = tmp_path / "shard.tar"
    _writers()[writer](path)
    data = bytearray(path.read_bytes())
    body = len(data.rstrip(b"\0"))
    if damage == "cut_in_data":
        data = data[:body - 50]
    elif damage == "cut_in_header":
        data = data[:(body // 512 - 1) * 512 + 100]
    elif damage == "bad_checksum":
        data[512 * 3 + 148:512 * 3 + 150] = b"77"
    elif damage == "garbage_tail":
        data = data[:body + (-body % 512)] + b"\x01" * 1024
    path.write_bytes(bytes(data))
    with open(path, "rb") as f:
        got = tarstream.index_members(f, LIMITS)
        f.seek(0)
        want = tarstream._index(tarstream._tarfile_headers(f), LIMITS)
    assert got == want
    if damage == "none":
        assert got  # the writers' tars hold samples


def test_plain_and_pax_tars_are_read_by_pread_and_others_by_tarfile(tmp_path):
    for name, fmt in (("ustar", tarfile.USTAR_FORMAT), ("pax", tarfile.PAX_FORMAT), ("gnu", tarfile.GNU_FORMAT)):
        _tarfile_made(tmp_path / f"{name}.tar", fmt, ["x" * 140 + ".jpg"] if name == "gnu" else NAMES)
    for name, plain in (("ustar", True), ("pax", True), ("gnu", False)):  # a GNU long name: tarfile's
        with open(tmp_path / f"{name}.tar", "rb") as f:
            if plain:
                assert list(tarstream._plain_headers(f.fileno()))
            else:
                with pytest.raises(tarstream._NotPlain):
                    list(tarstream._plain_headers(f.fileno()))


def test_a_reader_indexes_each_of_more_shards_than_sixteen_once_whatever_the_order(tmp_path):
    """A job reads by offset from every shard its shuffle draws on (16 open by default, and the
    shards whose samples still wait in its buffer): interleaved reads over 30 shards must not build
    a shard's index again while the members bound allows (a cache of 16 shards built 151 indexes for
    30 shards in one run). Past the bound, the least recently used index goes first."""
    import random

    from preprocess_service.adapters.io import shards

    paths = []
    for s in range(30):
        path = tmp_path / f"{s:05d}.tar"
        with wds.TarWriter(str(path)) as writer:
            for i in range(4):
                writer.write({"__key__": f"{s:05d}{i:04d}", "jpg": bytes([s, i]) * 50, "txt": b"caption"})
        paths.append(str(path))
    cache = shards._IndexCache()
    reader = shards.ShardReader()
    try:
        shards._tar_index = cache
        rng = random.Random(0)
        for _ in range(300):
            s = rng.randrange(30)
            key = f"{s:05d}{rng.randrange(4):04d}"
            got = reader.read_samples(paths[s], {key})
            assert got[key]["jpg"] == bytes([s, int(key[-4:])]) * 50  # by offset, the right bytes
        assert cache.builds == 30, f"{cache.builds} indexes built for 30 shards"
    finally:
        shards._tar_index = shards._IndexCache()
    small = shards._IndexCache(max_members=3 * 9)  # room for three shards of 4 samples x 2 members (+1)
    for path in paths[:4]:  # the fourth evicts paths[0]
        small(path, 0, 0, LIMITS)
    small(paths[1], 0, 0, LIMITS)  # used again: the oldest is now paths[2]
    small(paths[0], 0, 0, LIMITS)  # built again, evicting paths[2]
    assert small.builds == 5 and [k[0] for k in small._entries] == [paths[3], paths[1], paths[0]]
