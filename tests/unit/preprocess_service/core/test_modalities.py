"""Modalities are records (core/modalities/): a new kind of media is a record, a decoder and a
member kind (which tar members are it, read into its segment), and parsing, pricing, layout, the
output buffer, decoding and the delivered arrays follow it with no other change."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from disttrain_api.config import AudioConfig, CostConfig, ImageConfig
from preprocess_service.adapters.decode import InlineDecoder
from preprocess_service.adapters.decode.items import DECODERS, register_decoder
from preprocess_service.adapters.media import parse
from preprocess_service.adapters.media.parse import MEMBER_KINDS, MemberKind, parse_document, register_member_kind
from preprocess_service.core import modalities
from preprocess_service.core.assemble import finish, layout_microbatch
from preprocess_service.core.feedback import microbatch_features
from preprocess_service.core.modalities import MODALITIES, MODALITY_OF_SEGMENT, Modality
from preprocess_service.core.packing import PackedSequence, price
from preprocess_service.core.sample import Document, TextSegment
from preprocess_service.core.tokenizer import ByteTokenizer


@dataclass(slots=True)
class DepthRef:
    """A depth map: float32 [size, size], one token per row."""

    member: str
    size: int
    tokens: int


def _decode_depth(data: bytes, params: tuple, out):
    (size,) = params
    return np.frombuffer(data, dtype=np.float32).reshape(size, size)


@pytest.fixture
def depth():
    record = modalities.register(Modality(
        kind="depth", segment=DepthRef, code=9, placeholder="image_id", region="depth", dtype=np.float32,
        slot=lambda ref, audio: ((ref.size, ref.size), (ref.size,)),
        region_shape=lambda shapes, nbytes, audio: (len(shapes), *(shapes[0] if shapes else (0, 0))),
    ))
    register_decoder("depth", _decode_depth)
    register_member_kind(MemberKind("depth", ("depth",), 2, _read_depth))
    yield record
    del MODALITIES["depth"], MODALITY_OF_SEGMENT[DepthRef], DECODERS["depth"], MEMBER_KINDS["depth"]
    del parse._KIND_OF_EXT["depth"]


def _read_depth(member: str, data: bytes, sample) -> DepthRef:
    size = int(len(data) ** 0.5 / 2)  # float32 [size, size]
    return DepthRef(member, size, size)


def test_a_new_modality_is_read_from_its_tar_member_laid_out_decoded_and_delivered(depth):
    """From the raw sample (a ``.depth`` member beside the caption) to the delivered array."""
    array = np.arange(16, dtype=np.float32).reshape(4, 4)
    doc = parse_document({"__key__": "k", "__url__": "mem", "txt": b"a depth map", "depth": array.tobytes()},
                         image_config=ImageConfig(), tokenizer=ByteTokenizer(), seq_len=64)
    assert [type(s) for s in doc.segments] == [DepthRef, TextSegment]  # media first, then text (rank)
    layout = layout_microbatch([PackedSequence(seq_len=64, documents=[doc])], seq_len=64,
                               tokenizer=ByteTokenizer(), audio_config=AudioConfig())
    decoded = InlineDecoder(num_threads=1).submit(layout).result()
    np.testing.assert_array_equal(finish(layout, decoded.buffer).arrays["depth"], array[None])


def test_a_new_modality_is_laid_out_decoded_and_delivered(depth):
    maps = {f"d{i}": np.arange(16, dtype=np.float32).reshape(4, 4) * (i + 1) for i in range(2)}
    docs = [Document(key=key, shard="mem", segments=(TextSegment("txt", np.arange(5, dtype=np.int32)),
                                                     DepthRef("depth.bin", 4, 4)),
                     media_bytes={"depth.bin": array.tobytes()}) for key, array in maps.items()]
    sequence = PackedSequence(seq_len=32, documents=docs)
    layout = layout_microbatch([sequence], seq_len=32, tokenizer=ByteTokenizer(), audio_config=AudioConfig())
    decoded = InlineDecoder(num_threads=1).submit(layout).result()
    assert not decoded.errors
    arrays = finish(layout, decoded.buffer).arrays
    np.testing.assert_array_equal(arrays["depth"], np.stack(list(maps.values())))
    spans = arrays["depth_spans"]
    assert spans.tolist() == [[6, 10], [17, 21]]  # BOS, 5 text tokens, then the map; the second document after
    for start, end in spans:
        assert (arrays["modality"].reshape(-1)[start:end] == 9).all()
        assert (arrays["tokens"].reshape(-1)[start:end] == ByteTokenizer().image_id).all()
    assert arrays["pixels"].size == 0 and arrays["image_spans"].shape == (0, 2)  # the others are still there


def test_a_new_modality_is_priced_by_the_module_it_names(depth):
    config = CostConfig()
    doc = Document(key="d", shard="mem", segments=(TextSegment("txt", np.arange(5, dtype=np.int32)),
                                                   DepthRef("depth.bin", 4, 4)))
    priced = price(PackedSequence(seq_len=32, documents=[doc]), config)
    assert priced.encoder_s == pytest.approx(config.enc_linear_s * 4 + config.enc_quadratic_s * 16)
    assert microbatch_features([PackedSequence(seq_len=32, documents=[doc])])[0] == (4.0, 16.0)


def test_a_modality_that_clashes_is_refused(depth):
    with pytest.raises(ValueError, match="clashes"):
        modalities.register(Modality(kind="other", segment=DepthRef, code=10, placeholder="image_id",
                                     region="other", dtype=np.uint8, slot=depth.slot,
                                     region_shape=depth.region_shape))
    with pytest.raises(ValueError, match="two decoders"):
        register_decoder("depth", _decode_depth)
