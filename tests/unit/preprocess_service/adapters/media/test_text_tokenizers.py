"""Tokenizers users bring: a BPE tokenizer.json and a sentencepiece model, both trained here on the
synthetic captions (nothing downloaded)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from disttrain_tools import synth
from preprocess_service.adapters.media.tokenizers import (
    ADDED_BOS,
    PLACEHOLDERS,
    HFTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
    load_tokenizer,
    train_bpe,
    train_sentencepiece,
)
from preprocess_service.core.tokenizer import ByteTokenizer

pytestmark = pytest.mark.unit


def _captions(n: int = 600) -> list[str]:
    rng = np.random.default_rng(0)
    return [synth._draw_caption(rng) for _ in range(n)]


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    return train_bpe(_captions(), tmp_path_factory.mktemp("bpe") / "tokenizer.json", vocab_size=400)


SP_VOCAB = 600


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory):
    return train_sentencepiece(_captions(), tmp_path_factory.mktemp("sp") / "captions.model", vocab_size=SP_VOCAB)


TEXTS = ["A red rose in the garden", "Zürich café at night, 4k", "", "日本 東京 skyline"]


def _special(tok) -> dict[str, int]:
    return {name: getattr(tok, name) for name in ("pad_id", "bos_id", "eos_id", "image_id", "audio_id", "gen_id")}


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
def test_round_trip_special_tokens_and_batch_encoding(kind, bpe_path, sp_path):
    tok = HFTokenizer(bpe_path) if kind == "hf" else SentencePieceTokenizer(sp_path)
    special = _special(tok)
    assert len(set(special.values())) == 6 and max(special.values()) < tok.vocab_size
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and not set(ids.tolist()) & set(special.values())
        assert tok.decode(ids) == text
    assert [a.tolist() for a in tok.encode_batch(TEXTS)] == [tok.encode(t).tolist() for t in TEXTS]
    # the text of a placeholder is not the placeholder: a caption cannot forge an image slot
    for forged in (*PLACEHOLDERS.values(), "<s>", "</s>", "<|pad|>"):
        assert not set(tok.encode(f"x {forged} y").tolist()) & set(special.values()), forged
    assert len(tok.encode("a red rose in the garden")) < len("a red rose in the garden")  # merges, not bytes


def test_own_bos_eos_are_kept_and_missing_tokens_are_added(bpe_path):
    tok = HFTokenizer(bpe_path)
    vocab = json.loads(bpe_path.read_text())["model"]["vocab"]
    assert tok.bos_id == vocab["<s>"] and tok.eos_id == vocab["</s>"]
    assert tok.added == ["<|pad|>", *PLACEHOLDERS.values()]
    assert tok.vocab_size == len(vocab) + 4


def test_sentencepiece_special_ids_follow_its_pieces(sp_path):
    tok = SentencePieceTokenizer(sp_path)
    assert (tok.bos_id, tok.eos_id) == (1, 2)  # sentencepiece's defaults
    assert {tok.pad_id, tok.image_id, tok.audio_id, tok.gen_id} == set(range(SP_VOCAB, SP_VOCAB + 4))
    assert tok.vocab_size == SP_VOCAB + 4 and ADDED_BOS not in tok.added


def test_load_by_spec_and_bad_files_name_the_problem(tmp_path, bpe_path, sp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert isinstance(load_tokenizer(str(bpe_path)), HFTokenizer)
    assert isinstance(load_tokenizer(f"sentencepiece:{sp_path}"), SentencePieceTokenizer)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="bad.json: not a tokenizers file"):
        load_tokenizer(str(bad))
    with pytest.raises(TokenizerError, match="not a sentencepiece model"):
        load_tokenizer(f"sentencepiece:{bad}")
    with pytest.raises(TokenizerError, match="cannot read"):
        load_tokenizer(str(tmp_path / "missing.model"))
    with pytest.raises(TokenizerError, match="is a directory"):
        load_tokenizer(f"hf:{tmp_path}")
    with pytest.raises(TokenizerError, match="expected 'byte'"):
        load_tokenizer("gpt2")


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
def test_a_job_tokenizes_with_the_spec_s_tokenizer_and_bounds_each_document(kind, bpe_path, sp_path, tmp_path):
    from disttrain_api.config import JobConfig
    from helpers import write_tiny_shards
    from preprocess_service.core.assemble import MODALITY_TEXT
    from preprocess_service.service.job import Job

    write_tiny_shards(tmp_path / "shards", num_shards=1, samples_per_shard=12)
    spec = f"hf:{bpe_path}" if kind == "hf" else str(sp_path)  # a bare .model path works too
    job = Job(JobConfig(shards=(str(tmp_path / "shards"),), seq_len=1024, tokenizer=spec))
    tok = job.tokenizer
    assert job.tokenizer_info["kind"] == kind and job.tokenizer_info["vocab_size"] == tok.vocab_size
    assert len(job.tokenizer_info["sha256"]) == 64 and "<|image|>" in job.tokenizer_info["added_tokens"]
    plan = job.step_plan(0)
    layout = job.assembly.layout(plan.microbatch(0, 0))
    tokens, modality = layout.arrays["tokens"].reshape(-1), layout.arrays["modality"].reshape(-1)
    cu, owner = layout.arrays["cu_seqlens"], layout.arrays["segment_doc"]
    docs = {doc.key: doc for seq in plan.microbatch(0, 0) for doc in seq.documents}
    assert len(docs) >= 2, "several documents packed in one sequence"
    for start, end, index in zip(cu[:-1], cu[1:], owner):
        if index < 0:
            assert (tokens[start:end] == tok.pad_id).all()
            continue
        assert tokens[start] == tok.bos_id and tokens[end - 1] == tok.eos_id
        body = tokens[start + 1:end - 1]
        assert not np.isin(body, [tok.bos_id, tok.eos_id, tok.pad_id]).any(), "one BOS and one EOS per document"
        text = body[modality[start + 1:end - 1] == MODALITY_TEXT]
        caption = docs[layout.sample_keys[index]].segments[-1]
        assert tok.decode(text) == tok.decode(caption.ids) and caption.tokens == len(text)
        assert (body[modality[start + 1:end - 1] != MODALITY_TEXT] == tok.image_id).all()


def test_a_tokenizer_path_obeys_the_shard_rules(bpe_path, tmp_path):
    from disttrain_api.config import JobConfig
    from disttrain_api.errors import ConfigError, PermissionDenied
    from helpers import write_tiny_shards
    from preprocess_service.adapters.io.shards import ShardReader
    from preprocess_service.adapters.io.sources import ShardPolicy
    from preprocess_service.service.job import Job

    write_tiny_shards(tmp_path, num_shards=1)
    config = JobConfig(shards=(str(tmp_path),), tokenizer=f"hf:{bpe_path}")
    fenced = ShardReader(policy=ShardPolicy(allowed_prefixes=(str(tmp_path),)))
    with pytest.raises(PermissionDenied, match="outside the prefixes"):
        Job(config, reader=fenced)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(bpe_path.read_bytes())
    assert Job(JobConfig(shards=(str(tmp_path),), tokenizer=str(folder))).tokenizer_info["kind"] == "hf"
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(bpe_path)  # a folder inside the prefixes, its file outside
    with pytest.raises(PermissionDenied, match="outside the prefixes"):
        Job(JobConfig(shards=(str(tmp_path),), tokenizer=str(folder)), reader=fenced)
    for bad, message in ((f"hf:{tmp_path}/../x.json", r"'\.\.'"), ("hf:http://h/t.json", "on the service's machine"),
                         (f"sentencepiece:{tmp_path}/00000.tar", "not a sentencepiece model"),
                         ("gpt2", "expected 'byte'"), (str(tmp_path), "a model folder holding")):
        with pytest.raises(ConfigError, match=message):
            Job(JobConfig(shards=(str(tmp_path),), tokenizer=bad))


def test_placeholders_cannot_be_forged_even_when_the_vocabulary_has_their_names(tmp_path):
    import io

    import sentencepiece

    texts = [f"a photo {t} of the caption {i}" for i in range(300) for t in ("<|image|>", "<|pad|>")]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model, vocab_size=80,
                                             user_defined_symbols=["<|image|>", "<|pad|>"], hard_vocab_limit=False,
                                             minloglevel=2)
    (tmp_path / "ud.model").write_bytes(model.getvalue())
    sp = SentencePieceTokenizer(tmp_path / "ud.model")
    # a word-level tokenizer whose ordinary vocabulary holds "<|image|>": text produces that id
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "<|image|>": 1, "x": 2, "y": 3, "<s>": 4}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "words.json"))
    hf = HFTokenizer(tmp_path / "words.json")
    assert hf.image_id != 1 and hf.bos_id != 4 and "<|image#1|>" in hf.added and "<s>" not in hf.added
    for tok in (sp, hf):
        special = set(_special(tok).values())
        assert len(special) == 6
        for text in ("<|image|>", "x <|image|> y", "<|pad|><|image|>", "<s>", "</s>"):
            assert not set(tok.encode(text).tolist()) & special, (type(tok).__name__, text)
    assert sp.image_id >= sp._sp.get_piece_size()


def test_a_tokenizer_file_is_read_within_bounds(tmp_path, monkeypatch):
    import os

    from preprocess_service.adapters.media import tokenizers as text_tokenizers

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(TokenizerError, match="FIFO"):
        HFTokenizer(fifo)  # fails at once: never blocks waiting for a writer
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2048)
    monkeypatch.setattr(text_tokenizers, "MAX_TOKENIZER_BYTES", 1024)
    with pytest.raises(TokenizerError, match="more than the 1024 bytes"):
        HFTokenizer(big)
