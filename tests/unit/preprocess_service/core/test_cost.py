import pytest

from disttrain_api.config import CostConfig
from helpers import make_document
from preprocess_service.core.cost import price_sequence
from preprocess_service.core.packing import PackedSequence, price


def test_price_follows_the_documented_formula():
    cfg = CostConfig(enc_linear_s=1.0, enc_quadratic_s=0.5, bb_linear_s=2.0, bb_quadratic_s=0.1,
                     gen_per_image_s=3.0, enc_backward_factor=2.0, bb_backward_factor=1.0, gen_backward_factor=0.5)
    cost = price_sequence(image_tokens=[2, 4], document_lengths=[10, 5], num_generated_images=2, config=cfg)
    assert cost.encoder_s == pytest.approx((2 + 0.5 * 4) + (4 + 0.5 * 16))
    assert cost.backbone_s == pytest.approx(2.0 * 15 + 0.1 * (100 + 25))
    assert cost.generator_s == pytest.approx(6.0)
    assert cost.total_s == pytest.approx(cost.encoder_s * 3 + cost.backbone_s * 2 + cost.generator_s * 1.5)


def test_frozen_encoder_has_no_backward():
    cfg = CostConfig(enc_frozen=True, bb_linear_s=0.0, bb_quadratic_s=0.0)
    cost = price_sequence(image_tokens=[100], document_lengths=[0], num_generated_images=0, config=cfg)
    assert cost.total_s == pytest.approx(cost.encoder_s)


def test_packed_sequence_is_priced_from_metadata_and_grows_with_images():
    cfg = CostConfig()
    text_only = PackedSequence(seq_len=8192, documents=[make_document("a", text_tokens=500)])
    with_images = PackedSequence(seq_len=8192, documents=[make_document("b", image_tokens=[400, 400], text_tokens=500)])
    assert price(with_images, cfg).encoder_s > 0 == price(text_only, cfg).encoder_s
    assert price(with_images, cfg).total_s > price(text_only, cfg).total_s
    # quadratic in image tokens: one 800-token image costs more than two 400-token ones
    one_big = PackedSequence(seq_len=8192, documents=[make_document("c", image_tokens=[800], text_tokens=500)])
    assert price(one_big, cfg).encoder_s > price(with_images, cfg).encoder_s
