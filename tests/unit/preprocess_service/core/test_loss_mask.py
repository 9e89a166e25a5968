"""Labels and loss masks, token by token, on hand-built samples.

With the byte tokenizer one token is one UTF-8 byte, so each row is drawn as a string, one
character per position (``B`` BOS, ``E`` EOS, ``I`` image, ``A`` audio, ``G`` generation query,
``.`` padding, the byte itself for text), and the trained labels read back as the text they train.
loss_mask[s, i] = 1 means position i is trained to predict tokens[s, i + 1].
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from disttrain_api import preprocess_pb2 as pb
from disttrain_api import wire
from disttrain_api.config import AudioConfig, GenerationConfig, ImageConfig
from disttrain_api.errors import SampleError
from helpers import jpeg_bytes
from preprocess_service.adapters.media.conversations import MAX_TURNS
from preprocess_service.adapters.media.parse import parse_document
from preprocess_service.core.assemble import finish, layout_microbatch
from preprocess_service.core.packing import PackedSequence
from preprocess_service.core.sample import Document, ImageRef, TextSegment
from preprocess_service.core.tokenizer import ByteTokenizer
from trainer.client import to_microbatch
from trainer.models.backbone import lm_loss, trained_tokens

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()
ACFG = AudioConfig()
IMAGE = jpeg_bytes(56, 56)  # 2 x 2 tokens of 28 x 28 pixels
IMAGE_TOKENS = 4
SPECIAL = {TOK.bos_id: "B", TOK.eos_id: "E", TOK.image_id: "I", TOK.audio_id: "A", TOK.gen_id: "G",
           TOK.pad_id: "."}


def parse(members: dict, meta: dict | None = None, *, seq_len: int = 128, key: str = "k") -> Document:
    sample = {"__key__": key, "__url__": "mem.tar", **members}
    if meta is not None:
        sample["json"] = json.dumps(meta).encode()
    return parse_document(sample, image_config=ImageConfig(), tokenizer=TOK, seq_len=seq_len, audio_config=ACFG,
                          generation=GenerationConfig(query_tokens=3))


def lay(rows: list[list[Document]], seq_len: int, skip: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
    sequences = [PackedSequence(seq_len=seq_len, documents=docs) for docs in rows]
    return layout_microbatch(sequences, seq_len=seq_len, tokenizer=TOK, audio_config=ACFG, skip=skip).arrays


def drawn(tokens: np.ndarray) -> str:
    return "".join(SPECIAL.get(int(t), chr(int(t))) for t in tokens)


def mask(arrays: dict[str, np.ndarray], row: int = 0) -> str:
    return "".join(str(int(v)) for v in arrays["loss_mask"][row])


def trained_runs(arrays: dict[str, np.ndarray], row: int = 0) -> list[str]:
    """The labels the mask trains, as text, one string per run of consecutive trained positions."""
    labels = wire.derive_labels(arrays["tokens"], arrays["loss_mask"])[row]
    runs, current = [], ""
    for label in labels:
        if label == wire.IGNORE_INDEX:
            runs, current = (runs + [current]) if current else runs, ""
        else:
            current += SPECIAL.get(int(label), chr(int(label)))
    return runs + ([current] if current else [])


def test_a_caption_trains_its_text_and_eos_never_the_image():
    doc = parse({"jpg": IMAGE, "txt": b"a cat"})
    arrays = lay([[doc]], 16)
    assert drawn(arrays["tokens"][0]) == "BIIIIa catE....."
    assert mask(arrays) == "0000111111000000"  # the last image token predicts "a"; "t" predicts EOS
    assert trained_runs(arrays) == ["a catE"]


def test_an_interleaved_document_trains_text_only_and_no_eos_after_audio():
    doc = parse({"txt": b"hi", "jpg": IMAGE, "1.txt": b"yo", "flac": b"priced from the JSON, never decoded"},
                {"order": ["txt", "jpg", "1.txt", "flac"], "duration": 0.16})
    arrays = lay([[doc]], 16)
    assert drawn(arrays["tokens"][0]) == "BhiIIIIyoAAAAE.."
    assert mask(arrays) == "1100001100000000"
    assert trained_runs(arrays) == ["hi", "yo"]


def test_a_generation_target_is_never_predicted_and_ends_the_document_without_eos_loss():
    doc = parse({"txt": b"draw", "jpg": IMAGE}, {"order": ["txt", "jpg"], "generate": ["jpg"]})
    arrays = lay([[doc]], 12)
    assert drawn(arrays["tokens"][0]) == "BdrawGGGE..."
    assert mask(arrays) == "111100000000"


def test_two_documents_in_a_row_train_nothing_across_the_boundary_or_on_padding():
    first, second = parse({"txt": b"ab"}, key="a"), parse({"txt": b"cd"}, key="b")
    arrays = lay([[first, second], [second]], 12)
    assert drawn(arrays["tokens"][0]) == "BabEBcdE...."
    assert mask(arrays, 0) == "111011100000"  # EOS of "a" does not predict BOS of "b"
    assert mask(arrays, 1) == "111000000000"
    labels = wire.derive_labels(arrays["tokens"], arrays["loss_mask"])
    assert labels[0].tolist() == [ord("a"), ord("b"), TOK.eos_id, -100, ord("c"), ord("d"), TOK.eos_id] + [-100] * 5
    assert (labels[:, -1] == -100).all()


def test_a_document_skipped_at_decode_becomes_padding_with_no_loss():
    first, second = parse({"jpg": IMAGE, "txt": b"ab"}, key="a"), parse({"txt": b"cd"}, key="b")
    kept = lay([[first, second]], 16, skip=frozenset({"a"}))
    alone = lay([[second]], 16)
    assert drawn(kept["tokens"][0]) == "BcdE............"
    for name in ("tokens", "modality", "loss_mask"):
        np.testing.assert_array_equal(kept[name], alone[name])


LLAVA = {"conversations": [
    {"from": "human", "value": "<image>\nWhat is it?"},
    {"from": "gpt", "value": "A cat."},
    {"from": "human", "value": "Color?"},
    {"from": "gpt", "value": "Black."},
]}
LLAVA_TEXT = "USER: IIII\nWhat is it?\nASSISTANT: A cat.\nUSER: Color?\nASSISTANT: Black."


def test_a_llava_conversation_trains_only_the_assistant_turns_and_the_final_eos():
    doc = parse({"jpg": IMAGE, "txt": b"a caption the conversation replaces"}, LLAVA)
    assert [s.member for s in doc.segments][:3] == ["json:conversations[0]:header", "jpg", "json:conversations[0]"]
    assert [s.trainable for s in doc.segments if isinstance(s, TextSegment)] == [False, False, False, True,
                                                                                 False, False, False, True]
    arrays = lay([[doc]], 80)
    row = drawn(arrays["tokens"][0])
    assert row == "B" + LLAVA_TEXT + "E" + "." * (80 - 2 - len(LLAVA_TEXT))
    assert trained_runs(arrays) == ["A cat.", "Black.E"]
    trained = np.flatnonzero(arrays["loss_mask"][0])
    first_answer = row.index("A cat.")
    assert trained[0] == first_answer - 1 and row[trained[0]] == " "  # "ASSISTANT: " predicts the answer
    assert trained[-1] == len("B" + LLAVA_TEXT) - 1  # the answer's last token predicts EOS
    assert (arrays["modality"][0][trained + 1] == 1).all()


def test_an_openai_conversation_with_image_parts_and_an_unplaced_image():
    meta = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                     {"type": "text", "text": " and the first."}]},
        {"role": "assistant", "content": "Same."},
    ]}
    doc = parse({"jpg": IMAGE, "1.jpg": IMAGE}, meta)
    assert [s.member for s in doc.segments if isinstance(s, ImageRef)] == ["1.jpg", "jpg"]  # unplaced first
    arrays = lay([[doc]], 80)
    text = "SYSTEM: Be brief.\nUSER: Compare IIII and the first.\nASSISTANT: Same."
    assert drawn(arrays["tokens"][0]).startswith("BIIII" + text + "E")
    assert trained_runs(arrays) == ["Same.E"]


def test_a_conversation_ending_with_a_user_turn_trains_no_eos():
    doc = parse({}, {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                                  {"role": "user", "content": "Bye"}]})
    arrays = lay([[doc]], 48)
    assert trained_runs(arrays) == ["Yo"]
    assert not doc.trains_eos


@pytest.mark.parametrize("meta, problem", [
    ({"conversations": [{"from": "robot", "value": "hi"}]}, "role 'robot'"),
    ({"conversations": [{"from": "human"}]}, "value None"),
    ({"conversations": [{"from": "human", "value": ["a"]}]}, "expected a string"),
    ({"conversations": ["human: hi"]}, "expected an object"),
    ({"conversations": []}, "non-empty list"),
    ({"conversations": {"from": "human"}}, "non-empty list"),
    ({"conversations": [{"from": ["gpt"], "value": "x"}]}, "role ['gpt']"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "content part"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "role 'tool'"),
    ({"messages": [], "conversations": []}, "holds both"),
    ({"conversations": [{"from": "human", "value": "x"}] * (MAX_TURNS + 1)}, f"more than {MAX_TURNS}"),
    ({"conversations": [{"from": "human", "value": "<image><image>"}]}, "2 <image> markers"),
    ({"conversations": [{"from": "human", "value": "hi"}], "order": ["jpg"]}, '"order"'),
])
def test_malformed_conversations_are_skipped_as_invalid_conversation(meta, problem):
    with pytest.raises(SampleError) as info:
        parse({"jpg": IMAGE}, meta, key="bad")
    assert info.value.kind == "invalid_conversation" and info.value.key == "bad" and info.value.shard == "mem.tar"
    assert problem in info.value.reason


def test_a_truncated_conversation_keeps_masks_consistent_and_trains_no_eos():
    full = len("B" + LLAVA_TEXT + "E")
    cut = 3  # "Black." loses its last 3 characters, and the EOS no longer ends the text
    doc = parse({"jpg": IMAGE}, LLAVA, seq_len=full - cut)
    assert doc.truncated and doc.num_tokens == full - cut and not doc.trains_eos
    arrays = lay([[doc]], full - cut)
    assert drawn(arrays["tokens"][0]) == "B" + LLAVA_TEXT[:-cut] + "E"
    assert trained_runs(arrays) == ["A cat.", "Bla"]

    early = parse({"jpg": IMAGE}, LLAVA, seq_len=len("BUSER: IIII\nWhat is it?\nASS") + 1)  # cut in a header
    arrays = lay([[early]], early.num_tokens)
    assert early.truncated and trained_runs(arrays) == []
    assert [s.tokens for s in early.segments if isinstance(s, TextSegment)][3:] == [0] * 5


def test_labels_are_derived_by_the_client_and_drive_the_trainers_loss():
    caption = parse({"jpg": IMAGE, "txt": b"a cat"}, key="cap")
    chat = parse({"jpg": IMAGE}, LLAVA, key="chat")
    layout = layout_microbatch([PackedSequence(seq_len=96, documents=[caption, chat]),
                                PackedSequence(seq_len=96, documents=[caption])],
                               seq_len=96, tokenizer=TOK, audio_config=ACFG)
    arrays = finish(layout, np.zeros(layout.nbytes, dtype=np.uint8)).arrays
    assert arrays["loss_mask"].dtype == np.uint8 and "labels" not in arrays  # no label bytes on the wire
    mb = to_microbatch(wire.encode_microbatch(pb.Microbatch(sample_keys=layout.sample_keys), arrays))
    np.testing.assert_array_equal(mb.loss_mask.numpy(), arrays["loss_mask"])
    assert mb.labels.dtype == torch.int64 and mb.labels.shape == mb.tokens.shape
    trained = mb.loss_mask.bool()
    assert torch.equal(mb.labels != -100, trained)
    assert torch.equal(mb.labels[:, :-1][trained[:, :-1]], mb.tokens[:, 1:][trained[:, :-1]].long())
    assert int(trained.sum()) == len("a catE") * 2 + len("A cat.Black.E")

    logits = torch.randn(mb.tokens.numel(), TOK.vocab_size)
    total, count = lm_loss(logits, mb.labels), trained_tokens(mb.labels)
    assert count == int(trained.sum())
    flat = trained.reshape(-1)
    expected = F.cross_entropy(logits[flat], mb.labels.reshape(-1)[flat])  # mean over trained tokens only
    torch.testing.assert_close(total / count, expected)


def test_a_microbatch_without_a_loss_mask_is_refused_by_name():
    layout = layout_microbatch([PackedSequence(seq_len=8, documents=[parse({"txt": b"x"})])], seq_len=8,
                               tokenizer=TOK, audio_config=ACFG)
    arrays = finish(layout, np.zeros(layout.nbytes, dtype=np.uint8)).arrays
    del arrays["loss_mask"]
    with pytest.raises(ValueError, match="loss_mask"):
        to_microbatch(wire.encode_microbatch(pb.Microbatch(), arrays))
    with pytest.raises(ValueError, match="must both be"):
        wire.derive_labels(np.zeros((2, 4), np.int32), np.zeros((2, 3), np.uint8))
