"""The small multimodal models on real microbatches from the service."""

from __future__ import annotations

import pytest
import torch

from disttrain_api.config import JobConfig
from disttrain_tools import synth
from preprocess_service.service.server import create_server
from trainer import DataClient
from trainer.models.backbone import Backbone, spans_index, stage_layers
from trainer.models.config import ModelConfig
from trainer.models.mllm import MultimodalModel, step_loss

CONFIG = ModelConfig(max_positions=2048)


@pytest.fixture(scope="module")
def microbatches(tmp_path_factory):
    root = tmp_path_factory.mktemp("model-shards")
    synth.main(["--out", str(root / "synth"), "--num-shards", "1", "--samples-per-shard", "120", "--seed", "3"])
    server, port, _ = create_server("127.0.0.1:0", decode_workers=0)
    job = JobConfig(shards=(str(root / "synth"),), seq_len=2048, num_microbatches=2)
    try:
        with DataClient(f"127.0.0.1:{port}", job, 0) as client:
            yield list(client)
    finally:
        server.stop(0).wait()


def test_encoders_produce_exactly_the_planned_media_tokens(microbatches):
    model = MultimodalModel(CONFIG)
    assert any(len(mb.images) for mb in microbatches) and any(len(mb.mels) for mb in microbatches)
    assert any(mb.gen_spans.shape[0] for mb in microbatches)
    for mb in microbatches:
        spans = lambda s: int((s[:, 1] - s[:, 0]).sum()) if s.numel() else 0  # noqa: E731
        assert model.image_encoder(mb.images).shape == (spans(mb.image_spans), CONFIG.dim)
        assert model.audio_encoder(mb.mels).shape == (spans(mb.audio_spans), CONFIG.dim)


def test_attention_is_causal_and_stays_inside_each_document(microbatches):
    torch.manual_seed(0)
    backbone = Backbone(CONFIG).eval()
    mb = max(microbatches, key=lambda m: len(m.cu_seqlens))
    cu = mb.cu_seqlens.tolist()
    assert len(cu) >= 4, "several documents in one microbatch"
    media = torch.zeros(0, CONFIG.dim)

    def hidden(tokens):
        x = backbone.embed_inputs(tokens, mb.position_ids, media, torch.zeros(0, dtype=torch.long))
        return backbone.run_blocks(x, cu, 0, CONFIG.layers)[0]

    base = hidden(mb.tokens)
    b = cu[2]  # the second segment ends here: change its last token
    changed = mb.tokens.clone().reshape(-1)
    changed[b - 1] = (changed[b - 1] + 1) % 256
    after = hidden(changed.reshape(mb.tokens.shape))
    torch.testing.assert_close(after[:b - 1], base[:b - 1])  # earlier tokens, this document and others
    torch.testing.assert_close(after[b:], base[b:])  # later documents never see it
    assert not torch.allclose(after[b - 1], base[b - 1])


def test_labels_are_next_text_tokens_of_the_same_document(microbatches):
    mb = microbatches[0]
    labels = mb.labels.reshape(-1)
    tokens, modality = mb.tokens.reshape(-1), mb.modality.reshape(-1)
    valid = (labels != -100).nonzero().flatten()
    assert len(valid) > 0 and labels.dtype == torch.int64
    assert torch.equal(labels[valid], tokens[valid + 1].long())
    assert bool((modality[valid + 1] == 1).all()), "no label on a placeholder or padding"
    for boundary in mb.cu_seqlens.tolist()[1:-1]:
        assert labels[boundary - 1] == -100, "no label across a document boundary"
    assert torch.equal(mb.labels != -100, mb.loss_mask.bool())


def test_stage_layers_cut_the_blocks_evenly():
    assert stage_layers(4, 2) == [(0, 2), (2, 4)]
    assert stage_layers(5, 3) == [(0, 2), (2, 3), (3, 5)]
    with pytest.raises(ValueError, match="cannot cut 2 blocks into 3 stages"):
        stage_layers(2, 3)


def test_generator_loss_is_seeded_and_trains_the_backbone_queries(microbatches):
    torch.manual_seed(0)
    model = MultimodalModel(CONFIG)
    mb = next(m for m in microbatches if m.gen_spans.shape[0])
    first = model(mb, torch.Generator().manual_seed(5))
    again = model(mb, torch.Generator().manual_seed(5))
    assert first.gen_count == mb.gen_spans.shape[0]
    torch.testing.assert_close(first.gen_sum, again.gen_sum)
    first.gen_sum.backward()
    assert model.backbone.blocks[-1].mlp[0].weight.grad.abs().sum() > 0, "the condition reaches the backbone"
    assert model.generator.inp.weight.grad.abs().sum() > 0


def test_loss_decreases_when_training_on_one_microbatch(microbatches):
    torch.manual_seed(0)
    model = MultimodalModel(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    batch = microbatches[:1]
    losses = []
    for _ in range(8):
        loss = step_loss([model(mb, torch.Generator().manual_seed(i)) for i, mb in enumerate(batch)], 1.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert spans_index(torch.zeros(0, 2, dtype=torch.int32)).numel() == 0


def test_a_step_on_another_device_keeps_every_tensor_there(microbatches):
    """The whole model's forward and backward on the meta device (no data, but every op checks that
    its inputs share one device), fed a host microbatch as the trainer is: the host facts (document
    boundaries, spans) read on the host, the tensors moved. An index, a constant or the noise built
    on the CPU and mixed into the step fails here as it would on a GPU."""
    model = MultimodalModel(CONFIG).to("meta")
    covered = set()
    for mb in microbatches:  # every microbatch with media, until images, audio and generation were all in one
        kinds = {k for k, n in (("image", len(mb.images)), ("audio", len(mb.mels)), ("gen", mb.gen_spans.shape[0]))
                 if n}
        if not kinds or kinds <= covered:
            continue
        covered |= kinds
        parts = model(mb, torch.Generator().manual_seed(0), device="meta")
        loss = step_loss([parts], 1.0)
        assert loss.device.type == "meta" and parts.lm_count > 0
        loss.backward()
        if "gen" in kinds:
            assert parts.gen_count > 0
            assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.generator.parameters())
    assert covered == {"image", "audio", "gen"}


@pytest.mark.parametrize("layout", [(1, 2, 1, 1), (1, 1, 2, 1), (0, 1, 2, 0), (0, 1, 1, 0)],
                         ids=["disaggregated", "disaggregated-pp2", "monolithic-pp2", "monolithic"])
def test_each_worker_moves_only_its_own_modules_to_its_device(layout):
    """A rank holds on its device the modules it runs and nothing else of the model (an encoder
    rank holds no backbone), and what it holds is what it trains (parameters())."""
    from disttrain_api.layout import PipelineLayout
    from trainer.runtime.workers import BackboneWorker, EncoderWorker, GeneratorWorker

    layout = PipelineLayout(*layout)
    for rank in range(layout.world_size):
        model, role = MultimodalModel(ModelConfig(layers=2, max_positions=2048)), layout.role(rank)
        common = (model, layout, 4, 0)
        if role[0] == "enc":
            worker = EncoderWorker(*common, replica=role[1], device="meta")
        elif role[0] == "gen":
            worker = GeneratorWorker(*common, replica=role[1], gen_weight=1.0, device="meta")
        else:
            worker = BackboneWorker(*common, dp=role[1], stage=role[2], device="meta")
        worker.to_device()
        own = {id(p) for p in worker.parameters()}
        assert own and len(own) == len(worker.parameters())
        moved = {id(p) for p in model.parameters() if p.device.type == "meta"}
        assert moved == own, f"rank {rank} ({role}) holds {len(moved)} parameters on its device, trains {len(own)}"


def test_videos_reach_the_trainer_and_its_encoder_fills_their_spans(tmp_path):
    """A video's frames reach the client as mb.videos; the reference encoder reads each temporal
    patch as one image (trainer/models/video.py), which fills exactly the video's planned tokens."""
    import json

    import webdataset as wds

    from disttrain_api.config import VideoConfig
    from helpers import jpeg_bytes, video_bytes
    from trainer.models.video import fold_videos

    with wds.TarWriter(str(tmp_path / "00000.tar")) as writer:
        for i in range(6):
            turns = [{"from": "human", "value": "<image> and <video>: what changes?"},
                     {"from": "gpt", "value": "Light."}]
            writer.write({"__key__": f"v{i}", "mp4": video_bytes(24 + 12 * i, 84, 56, 12),
                          "jpg": jpeg_bytes(60, 60, seed=i), "json": json.dumps({"conversations": turns}).encode()})
    server, port, _ = create_server("127.0.0.1:0", decode_workers=0)
    job = JobConfig(shards=(str(tmp_path),), seq_len=2048, num_microbatches=2,
                    video=VideoConfig(fps=4.0, max_frames=8))
    try:
        with DataClient(f"127.0.0.1:{port}", job, 0) as client:
            batches = list(client)
    finally:
        server.stop(0).wait()
    model = MultimodalModel(CONFIG)
    assert sum(len(mb.videos) for mb in batches) == 6
    for mb in batches:
        for video, (start, end) in zip(mb.videos, mb.video_spans.tolist()):
            frames, h, w, _ = video.shape
            assert frames % 2 == 0 and end - start == frames // 2 * (h // 28) * (w // 28)
            assert (mb.modality.reshape(-1)[start:end] == 5).all()
        folded = fold_videos(mb, 28)
        covered = int((folded.image_spans[:, 1] - folded.image_spans[:, 0]).sum())
        assert covered == int((mb.image_spans[:, 1] - mb.image_spans[:, 0]).sum()
                              + (mb.video_spans[:, 1] - mb.video_spans[:, 0]).sum())
        assert model.image_encoder(folded.images).shape == (covered, CONFIG.dim)
        parts = model(mb, torch.Generator().manual_seed(0))
        assert torch.isfinite(parts.lm_sum)
