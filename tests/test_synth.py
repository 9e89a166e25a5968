"""Tests for preprocess_service.synth: layout, metadata consistency, determinism, skew, corrupt shard."""

from __future__ import annotations

import hashlib
import io
import json
import re
import statistics
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from preprocess_service import synth

MEMBER = re.compile(r"^(\d{5})(\d{4})\.(?:(\d+)\.)?(jpg|png|webp|txt|json)$")
IMAGE_EXTS = ("jpg", "png", "webp")
SKEW_CONFIG = synth.SynthConfig(num_shards=2, samples_per_shard=200, seed=0)


def read_samples(tar_path: Path) -> dict[str, dict[str, bytes]]:
    """{key: {extension: bytes}}, splitting member names at the first dot as webdataset does."""
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(tar_path) as tar:
        for member in tar.getmembers():
            key, ext = member.name.split(".", 1)
            samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    return samples


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, list[Path]]:
    """One ~400-sample dataset shared by the layout, consistency and skew tests (generation dominates runtime)."""
    out = tmp_path_factory.mktemp("synth")
    return out, synth.write_dataset(out, SKEW_CONFIG)


@pytest.fixture(scope="module")
def all_metas(dataset) -> list[dict]:
    _, tars = dataset
    return [json.loads(s["json"]) for tar in tars for s in read_samples(tar).values()]


def test_layout(dataset):
    out, tars = dataset
    assert tars == [out / "00000.tar", out / "00001.tar"]
    for shard in range(SKEW_CONFIG.num_shards):
        stats = json.loads((out / f"{shard:05d}_stats.json").read_text())
        n = SKEW_CONFIG.samples_per_shard
        assert stats["count"] == stats["successes"] == n
        assert stats["status_dict"] == {"success": n}
        assert stats["failed_to_download"] == stats["failed_to_resize"] == 0
        assert stats["end_time"] >= stats["start_time"]
    assert (out / synth.MARKER_NAME).is_file()


def test_member_names_encode_shard_and_index(dataset):
    _, tars = dataset
    for shard, tar_path in enumerate(tars):
        with tarfile.open(tar_path) as tar:
            names = tar.getnames()
        indexes = set()
        for name in names:
            match = MEMBER.match(name)
            assert match, name
            assert int(match.group(1)) == shard
            indexes.add(int(match.group(2)))
        assert indexes == set(range(SKEW_CONFIG.samples_per_shard))


def check_sample(key: str, members: dict[str, bytes], meta: dict) -> None:
    first_ext = next(ext for ext in IMAGE_EXTS if ext in members)
    assert meta["key"] == key and meta["status"] == "success" and meta["error_message"] is None
    assert members["txt"].decode("utf-8") == meta["caption"]
    assert meta["sha256"] == hashlib.sha256(members[first_ext]).hexdigest()
    assert meta["url"].endswith(f"{key}.{first_ext}")
    assert 0.25 <= meta["similarity"] <= 0.4
    assert meta["original_width"] >= meta["width"] and meta["original_height"] >= meta["height"]
    extra = sorted(int(ext.split(".")[0]) for ext in members if ext.count(".") == 1)
    assert extra == list(range(1, meta["num_images"]))
    # The json describes the stored pixel array (EXIF orientation is not applied), as img2dataset does.
    sizes = [Image.open(io.BytesIO(members[first_ext])).size]
    sizes += [Image.open(io.BytesIO(members[f"{i}.jpg"])).size for i in extra]
    assert sizes[0] == (meta["width"], meta["height"])
    if meta["num_images"] > 1:
        assert [(d["width"], d["height"]) for d in meta["images"]] == sizes
    else:
        assert "images" not in meta


def test_json_matches_images_and_parquet(dataset):
    out, tars = dataset
    rotated = 0
    for shard, tar_path in enumerate(tars):
        samples = read_samples(tar_path)
        metas = {key: json.loads(members["json"]) for key, members in samples.items()}
        for key, members in samples.items():
            check_sample(key, members, metas[key])
        rotated += sum(
            Image.open(io.BytesIO(m["jpg"])).getexif().get(0x0112) == 6 for m in samples.values() if "jpg" in m
        )
        table = pq.read_table(out / f"{shard:05d}.parquet")
        assert table.num_rows == len(samples)
        for row in table.to_pylist():
            expected = {k: v for k, v in metas[row["key"]].items() if k != "images"}
            assert row == expected
    assert rotated > 0  # some JPEGs carry EXIF orientation 6


def test_formats_and_utf8(all_metas, dataset):
    _, tars = dataset
    exts = {ext for tar in tars for members in read_samples(tar).values() for ext in members}
    assert {"jpg", "png", "webp", "1.jpg", "txt", "json"} <= exts
    assert any(not meta["caption"].isascii() for meta in all_metas)


def test_skew(all_metas):
    assert len(all_metas) == 400
    short_sides = [min(d["width"], d["height"]) for m in all_metas for d in m.get("images", [m])]
    assert 300 <= statistics.median(short_sides) <= 650
    assert max(short_sides) > 1500
    assert min(short_sides) >= 150 and max(short_sides) <= 3000
    words = [len(m["caption"].split()) for m in all_metas]
    assert 8 <= statistics.median(words) <= 18
    assert max(words) > 60
    multi_share = sum(m["num_images"] > 1 for m in all_metas) / len(all_metas)
    assert 0.04 <= multi_share <= 0.20
    assert max(m["num_images"] for m in all_metas) <= 8


def test_same_seed_gives_identical_tars(tmp_path):
    config = synth.SynthConfig(num_shards=1, samples_per_shard=30, seed=7)
    first = synth.write_dataset(tmp_path / "a", config)[0].read_bytes()
    second = synth.write_dataset(tmp_path / "b", config)[0].read_bytes()
    assert first == second
    other = synth.write_dataset(tmp_path / "c", synth.SynthConfig(num_shards=1, samples_per_shard=30, seed=8))
    assert other[0].read_bytes() != first


def test_ensure_dataset_reuses_only_a_matching_dataset(tmp_path):
    config = synth.SynthConfig(num_shards=2, samples_per_shard=3)
    paths = synth.ensure_dataset(tmp_path, config)
    stamps = [p.stat().st_mtime_ns for p in paths]
    assert synth.ensure_dataset(tmp_path, config) == paths
    assert [p.stat().st_mtime_ns for p in paths] == stamps
    smaller = synth.SynthConfig(num_shards=1, samples_per_shard=3, seed=1)
    assert synth.ensure_dataset(tmp_path, smaller) == [tmp_path / "00000.tar"]
    assert not (tmp_path / "00001.tar").exists()  # stale shard of the earlier, bigger run removed
    assert json.loads((tmp_path / synth.MARKER_NAME).read_text())["config"]["seed"] == 1


@pytest.mark.parametrize(
    "kwargs",
    [{"num_shards": 0}, {"samples_per_shard": 10001}, {"seed": -1}, {"max_images": 1},
     {"multi_image_share": 1.5}, {"png_share": 0.6, "webp_share": 0.6}, {"num_shards": 2.0},
     {"webp_share": "0.1"}],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        synth.SynthConfig(**kwargs)


def check_bad_sample(kind: str, members: dict[str, bytes]) -> None:
    if kind == "truncated_image":
        with pytest.raises(OSError):
            Image.open(io.BytesIO(members["jpg"])).load()
    elif kind == "random_bytes_image":
        with pytest.raises(Image.UnidentifiedImageError):
            Image.open(io.BytesIO(members["jpg"]))
    elif kind == "bad_utf8":
        with pytest.raises(UnicodeDecodeError):
            members["txt"].decode("utf-8")
    elif kind == "invalid_json":
        with pytest.raises(json.JSONDecodeError):
            json.loads(members["json"])
    else:
        assert kind == "decompression_bomb"
        assert json.loads(members["json"])["width"] == synth.BOMB_SIDE
        with pytest.raises(Image.DecompressionBombError):
            Image.open(io.BytesIO(members["png"]))


def test_corrupt_shard(tmp_path):
    path = tmp_path / "corrupt.tar"
    bad = synth.write_corrupt_shard(path, seed=0)
    assert sorted(bad.values()) == sorted(synth.CORRUPT_KINDS)
    samples = read_samples(path)
    assert len(samples) == 25 and set(bad) <= set(samples)
    for key, members in samples.items():
        assert MEMBER.match(f"{key}.txt") and key.startswith(f"{synth.CORRUPT_SHARD_ID:05d}")
        if key in bad:
            check_bad_sample(bad[key], members)
        else:
            check_sample(key, members, json.loads(members["json"]))
    assert synth.write_corrupt_shard(tmp_path / "again.tar", seed=0) == bad
    assert (tmp_path / "again.tar").read_bytes() == path.read_bytes()


def test_main_writes_shards_and_corrupt_tar(tmp_path, capsys):
    assert synth.main(["--out", str(tmp_path), "--num-shards", "1", "--samples-per-shard", "4", "--corrupt"]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"00000.tar", "00000.parquet", "00000_stats.json", "corrupt.tar", synth.MARKER_NAME} <= names
    assert "shard 1/1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        synth.main(["--out", str(tmp_path), "--num-shards", "0"])
