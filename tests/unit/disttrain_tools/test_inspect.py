"""Tests for ``python -m disttrain_tools inspect`` (disttrain_tools/inspect_cli.py, inspect_plot.py) and the
statistics under it (disttrain_tools/datastats.py): numbers checked against what tiny shards hold."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from disttrain_tools import cli, datastats, inspect_cli
from helpers import jpeg_bytes, make_document, write_tiny_shards
from preprocess_service.core.sample import AudioRef, Document, GenImageRef, ImageRef, TextSegment

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def captions(paths: list[Path]) -> dict[str, str]:
    """{key: caption} of every sample, read with tarfile, apart from the service."""
    out = {}
    for path in paths:
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".txt"):
                    out[member.name.split(".", 1)[0]] = tar.extractfile(member).read().decode()
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[Path]:
    return write_tiny_shards(tmp_path_factory.mktemp("tiny") / "a", num_shards=2, samples_per_shard=12)


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = inspect_cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_numbers_match_the_shards(shards, tmp_path, capsys):
    code, out, _ = run([str(shards[0].parent), "--json", str(tmp_path / "s.json"), "--no-plot", "--dp-size", "2",
                        "--seq-len", "2048", "--shuffle-buffer", "4"], capsys)
    assert code == 0
    stats = json.loads((tmp_path / "s.json").read_text())
    texts = captions(shards)
    assert stats["samples"] == {"read": 24, "accepted": 24, "planned": 24, "skipped": 0, "skipped_by_kind": {}}
    assert stats["modalities"] == {"image-text": 24, "audio": 0, "video": 0, "interleaved": 0, "conversation": 0,
                                   "text-only": 0,
                                   "generation": 0}
    dist = stats["distributions"]
    assert dist["image_tokens"]["count"] == 24 + 4  # a second image in samples 4 and 9 of each shard
    lengths = sorted(len(t) for t in texts.values())
    assert dist["text_chars"]["count"] == 24
    assert (dist["text_chars"]["min"], dist["text_chars"]["max"]) == (lengths[0], lengths[-1])
    assert dist["text_chars"]["p50"] == pytest.approx(float(np.percentile(lengths, 50)))
    assert dist["text_tokens"] == dist["text_chars"]  # the byte tokenizer, ASCII captions
    assert dist["manifest_caption_chars"] == {"count": 0}  # the helper's parquet files are fakes
    assert stats["manifests"]["shards"] == 0 and stats["steps"]["count"] >= 1
    assert dist["step_imbalance"]["count"] == stats["steps"]["count"]
    assert sum(stats["modalities"].values()) == stats["samples"]["planned"]
    assert "image-text 24 (100%)" in out and "text characters per document" in out
    assert "no img2dataset manifest" in out and "lower bound" in out


LLAVA = {"conversations": [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."},
                           {"from": "human", "value": "Color?"}, {"from": "gpt", "value": "Black."}]}
OPENAI = {"messages": [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": [{"type": "text", "text": "Say hi"}]},
                       {"role": "assistant", "content": "hi"}]}
# as the model reads them: role headers and turns, the <image> marker taken by the image
LLAVA_TEXT = "USER: \nWhat is it?\nASSISTANT: A cat.\nUSER: Color?\nASSISTANT: Black."
OPENAI_TEXT = "SYSTEM: Be brief.\nUSER: Say hi\nASSISTANT: hi"


def test_conversations_are_their_own_class_and_their_text_is_counted(tmp_path, capsys):
    extra = {"convo-llava": {"jpg": jpeg_bytes(56, 56), "json": json.dumps(LLAVA).encode()},
             "convo-openai": {"json": json.dumps(OPENAI).encode()}}
    paths = write_tiny_shards(tmp_path / "d", num_shards=1, samples_per_shard=6, extra=extra)
    code, out, _ = run([str(paths[0]), "--no-plot", "--json", str(tmp_path / "s.json")], capsys)
    stats = json.loads((tmp_path / "s.json").read_text())
    assert code == 0
    assert stats["samples"] == {"read": 8, "accepted": 8, "planned": 8, "skipped": 0, "skipped_by_kind": {}}
    assert stats["modalities"]["conversation"] == 2 and stats["modalities"]["image-text"] == 6
    assert stats["modalities"]["interleaved"] == 0
    lengths = sorted([len(t) for t in captions(paths).values()] + [len(LLAVA_TEXT), len(OPENAI_TEXT)])
    dist = stats["distributions"]
    assert dist["text_chars"]["count"] == 8 and dist["text_chars"]["min"] == lengths[0]
    assert dist["text_chars"]["max"] == lengths[-1]
    assert dist["text_tokens"] == dist["text_chars"]  # the byte tokenizer, ASCII text: headers counted too
    assert "conversation 2 (25%)" in out


def test_png_is_written_and_valid(shards, tmp_path, capsys):
    plot = tmp_path / "out.png"
    code, out, _ = run([str(shards[0]), "--plot", str(plot)], capsys)
    assert code == 0 and f"plot written to {plot}" in out
    assert plot.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(plot) as image:
        image.verify()
        assert image.size[0] > 500


def test_default_plot_in_the_current_directory_through_the_main_cli(shards, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["inspect", str(shards[1])]) == 0
    assert (tmp_path / "inspect.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "samples   read 12, accepted 12" in capsys.readouterr().out


def test_plot_without_matplotlib_is_a_clear_message(shards, tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.chdir(tmp_path)
    code, out, err = run([str(shards[0])], capsys)
    assert code == 0 and "samples" in out and "pip install 'disttrain[inspect]'" in err
    code, _, err = run([str(shards[0]), "--plot", str(tmp_path / "p.png")], capsys)
    assert code == 2 and "matplotlib" in err


def test_mixture_file(shards, tmp_path, capsys):
    other = write_tiny_shards(tmp_path / "b", num_shards=1, samples_per_shard=5, seed=3)
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"datasets": [
        {"name": "laion", "shards": [str(shards[0].parent)], "weight": 0.7},
        {"name": "other", "shards": str(other[0].parent), "weight": 0.3, "modalities": ["text"]}],
        "mix_epoch": "all_exhausted"}))
    code, out, _ = run(["--mix", str(mix), "--no-plot", "--json", str(tmp_path / "s.json")], capsys)
    assert code == 0
    stats = json.loads((tmp_path / "s.json").read_text())
    by_name = {d["name"]: d for d in stats["datasets"]}
    assert by_name["laion"]["planned"] == by_name["laion"]["modalities"]["image-text"] >= 24
    assert by_name["other"]["planned"] == by_name["other"]["modalities"]["text-only"] >= 5  # images dropped
    assert "2 datasets" in out and "laion" in out and "other" in out


def test_img2dataset_manifests_are_used(tmp_path, capsys):
    paths = write_tiny_shards(tmp_path / "d", num_shards=2, samples_per_shard=4)
    rows = [{"key": f"0000{i:05d}", "status": "success", "caption": "x" * (10 + i), "original_width": 1000 + i,
             "original_height": 500, "error_message": None, "url": f"https://h/{i}"} for i in range(4)]
    rows += [{"key": f"0000{i:05d}", "status": "failed_to_download", "caption": "lost", "original_width": None,
              "original_height": None, "error_message": "HTTP Error 404", "url": f"https://h/{i}"}
             for i in range(4, 4 + 40)]  # more than the manifest keeps one by one: all are counted
    pq.write_table(pa.Table.from_pylist(rows), paths[0].with_suffix(".parquet"))  # shard 1 keeps its fake
    code, out, _ = run([str(paths[0].parent), "--no-plot", "--json", str(tmp_path / "s.json")], capsys)
    stats = json.loads((tmp_path / "s.json").read_text())
    assert code == 0
    assert stats["manifests"] == {"shards": 1, "of_shards": 2, "samples": 4, "failed_rows": 40}
    assert stats["distributions"]["manifest_original_width"]["max"] == 1003
    assert stats["distributions"]["manifest_caption_chars"]["min"] == 10
    assert "manifests of 1 of 2 shards: 4 samples, 40 failed-download rows" in out
    assert "caption characters *" in out


def test_max_samples_bounds_the_work(shards, capsys, tmp_path):
    code, out, _ = run([str(shards[0].parent), "--max-samples", "3", "--no-plot", "--seq-len", "1024",
                        "--shuffle-buffer", "1", "--pack-window", "1", "--json", str(tmp_path / "s.json")], capsys)
    stats = json.loads((tmp_path / "s.json").read_text())
    assert code == 0 and 3 <= stats["samples"]["planned"] < 24 and stats["steps"]["count"] == 1
    assert "up to --max-samples" in out


@pytest.mark.parametrize("argv, message", [
    (["/no/such/dir/x.tar"], "does not exist"),
    ([], "give SHARDS or --mix FILE"),
    (["--mix", "/no/such/mix.json"], "/no/such/mix.json"),
    (["--max-samples", "0", "x.tar"], "--max-samples"),
])
def test_bad_input_is_a_clear_error(argv, message, capsys):
    code, out, err = run(argv, capsys)
    assert code == 2 and message in err and err.startswith("error: ") and not out


def test_bad_mix_file(tmp_path, shards, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run(["--mix", str(bad)], capsys)
    assert code == 2 and "bad.json" in err and "invalid JSON" in err
    both = tmp_path / "mix.json"
    both.write_text(json.dumps([{"name": "a", "shards": str(shards[0])}]))
    code, _, err = run(["--mix", str(both), str(shards[0])], capsys)
    assert code == 2 and "one of them" in err


def test_modality_classes():
    text = TextSegment("txt", np.arange(5, dtype=np.int32))
    image = ImageRef("jpg", 28, 56, 2)
    clip = AudioRef("flac", 1.5, 40, 10)
    target = GenImageRef("1.jpg", 256, 64)

    def doc(*segments) -> Document:
        return Document(key="k", shard="s", segments=segments)

    assert datastats.modality_of(doc(image, text)) == "image-text"
    assert datastats.modality_of(doc(image, image, text)) == "image-text"
    assert datastats.modality_of(doc(image, clip, text)) == "audio"
    assert datastats.modality_of(doc(text, image, text)) == "interleaved"
    assert datastats.modality_of(doc(text, clip, text)) == "interleaved"
    assert datastats.modality_of(doc(text, target)) == "generation"
    assert datastats.modality_of(doc(text)) == "text-only"
    header = TextSegment("json:conversations[0]:header", np.arange(6, dtype=np.int32), trainable=False)
    answer = TextSegment("json:conversations[1]", np.arange(3, dtype=np.int32))
    assert datastats.modality_of(doc(header, image, text, header, answer)) == "conversation"
    assert datastats.modality_of(doc(header, text)) == "conversation"
    assert datastats.modality_of(doc(header, text, target)) == "generation"


def test_compute_stats_is_pure_and_exact():
    docs = [make_document(f"{i:09d}", image_tokens=[4 * (i + 1)], text_tokens=i + 1) for i in range(10)]
    facts = [datastats.document_facts(d, text_chars=2 * (i + 1)) for i, d in enumerate(docs)]
    stats = datastats.compute_stats(facts, [], dataset_names=["default"], skipped={"bad_utf8": 2,
                                    "download_failed": 3}, num_parsed=12)
    assert stats["samples"] == {"read": 14, "accepted": 12, "planned": 10, "skipped": 2,
                                "skipped_by_kind": {"download_failed": 3, "bad_utf8": 2}}
    dist = stats["distributions"]
    assert dist["image_tokens"] == {"count": 10, "min": 4, "p10": 7.6, "p50": 22, "p90": 36.4, "p99": 39.64,
                                    "max": 40, "mean": 22}
    assert (dist["text_chars"]["min"], dist["text_chars"]["max"]) == (2, 20)
    assert dist["image_width"]["max"] == 28 * 40 and dist["step_imbalance"] == {"count": 0}
    assert stats["modalities"]["image-text"] == 10 and stats["steps"]["count"] == 0


def test_it_counts_turned_images_and_videos_and_manifest_sizes_the_bytes_overrule(tmp_path, capsys):
    """Camera originals planned from their manifest (EXIF orientations 1-8, a PNG's eXIf 6, one
    row declaring a wrong size) and a tar of videos (one turned by its display matrix, one not)."""
    import image_corpus
    import webdataset as wds

    from helpers import video_bytes

    classes = {k: c for k, c in image_corpus.CLASSES.items() if "orient" in k or k == "jpeg_grey"}
    image_corpus.write_corpus(tmp_path / "photos", classes)
    table = pq.read_table(tmp_path / "photos" / "00000.parquet").to_pylist()
    for row in table:
        if row["key"] == "jpeg_orient1":
            row["width"] += 100  # the bytes overrule it
    pq.write_table(pa.Table.from_pylist(table, schema=image_corpus.PARQUET_SCHEMA),
                   tmp_path / "photos" / "00000.parquet")
    quarter_turn = [0, 65536, 0, -65536, 0, 0, 0, 0, 1 << 30]
    with wds.TarWriter(str(tmp_path / "videos.tar")) as writer:
        for key, matrix in (("upright", None), ("turned", quarter_turn)):
            writer.write({"__key__": key, "mp4": video_bytes(12, 160, 96, display_matrix=matrix),
                          "txt": b"a clip"})
    code, out, _ = run([str(tmp_path / "photos"), str(tmp_path / "videos.tar"), "--no-plot",
                        "--json", str(tmp_path / "s.json")], capsys)
    stats = json.loads((tmp_path / "s.json").read_text())
    assert code == 0, out
    assert stats["manifests"]["shards"] == 2  # the photos' jpg and png shards are planned from their parquet
    assert stats["orientations"] == {"samples_oriented_images": 8, "samples_oriented_videos": 1,
                                     "declared_size_mismatches": 1}  # JPEG 2-8, the PNG; the turned clip
    assert "8 samples with images turned or mirrored" in out and "1 with videos" in out
    assert "1 manifest sizes disagree" in out
