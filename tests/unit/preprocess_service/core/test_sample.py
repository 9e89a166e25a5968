import json

import pytest

from disttrain_api.config import ImageConfig
from disttrain_api.errors import SampleError
from helpers import jpeg_bytes
from preprocess_service.adapters.media.parse import parse_document
from preprocess_service.core.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _parse(members, seq_len=8192, image_config=ImageConfig()):
    sample = {"__key__": "000000007", "__url__": "shard.tar", **members}
    return parse_document(sample, image_config=image_config, tokenizer=TOK, seq_len=seq_len)


def test_document_is_priced_from_metadata_with_images_in_member_order():
    doc = _parse({"jpg": jpeg_bytes(560, 280), "2.png": jpeg_bytes(56, 56, fmt="PNG"),
                  "1.webp": jpeg_bytes(112, 112, fmt="WEBP"), "txt": "héllo".encode(),
                  "json": json.dumps({"width": 560, "height": 280}).encode()})
    assert [img.member for img in doc.images] == ["jpg", "1.webp", "2.png"]
    assert [img.tokens for img in doc.images] == [200, 16, 4]
    assert doc.num_tokens == 2 + 220 + len("héllo".encode())
    assert doc.media_bytes is not None and set(doc.media_bytes) == {"jpg", "1.webp", "2.png"}


def test_caption_falls_back_to_json_and_long_text_is_truncated_to_fit():
    doc = _parse({"jpg": jpeg_bytes(56, 56), "json": json.dumps({"caption": "x" * 500}).encode()}, seq_len=100)
    assert doc.num_tokens == 100 and doc.truncated


@pytest.mark.parametrize("members,reason", [
    ({"jpg": b"\x89garbage" * 50, "txt": b"a"}, "not a readable image"),
    ({"jpg": jpeg_bytes(600, 600)[:3000], "txt": b"a"}, "truncated JPEG"),
    ({"jpg": jpeg_bytes(56, 56), "txt": b"\xff\xfe\xfa"}, "not valid UTF-8"),
    ({"jpg": jpeg_bytes(56, 56), "json": b'{"width": 3'}, "invalid JSON"),
    ({"json": b"[1, 2]"}, "JSON metadata is a list"),
    ({"json": b"{}"}, "has no image, audio or text"),
])
def test_bad_samples_raise_sample_error_naming_the_problem(members, reason):
    with pytest.raises(SampleError, match=reason) as info:
        _parse(members)
    assert info.value.key == "000000007" and info.value.shard == "shard.tar"


def test_decompression_bomb_is_rejected_from_the_header():
    cfg = ImageConfig(max_source_pixels=1000 * 1000)
    with pytest.raises(SampleError, match="decompression bomb: 1200x1000"):
        _parse({"jpg": jpeg_bytes(1200, 1000), "txt": b"a"}, image_config=cfg)


def test_images_that_cannot_fit_a_sequence_are_skipped_with_the_numbers():
    with pytest.raises(SampleError, match="needs 1026 tokens .* more than seq_len 512"):
        _parse({"jpg": jpeg_bytes(896, 896), "txt": b"a"}, seq_len=512)
