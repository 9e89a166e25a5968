"""Videos for the reference image encoder: each video's frames, ``temporal_patch`` at a time,
averaged into one image, whose tokens are that temporal patch's share of the video's span (the
service prices a video of n frames of h x w as n / temporal_patch images of h x w). A model with a
real temporal patch embedding (Qwen2-VL's 3D convolution) reads ``mb.videos`` itself instead."""

from __future__ import annotations

import dataclasses

import torch


def fold_videos(mb, factor: int):
    """``mb`` with its videos turned into images placed in their spans (``factor``: pixels along one
    token's side, patch_size * merge_size); ``mb`` itself when it holds none."""
    videos = getattr(mb, "videos", None)
    if not videos:
        return mb
    spans = [tuple(s) for s in mb.image_spans.numpy().tolist()]  # host tensors: .numpy() never waits on a device
    images = list(mb.images)
    for video, (start, end) in zip(videos, mb.video_spans.numpy().tolist()):
        frames, height, width, _ = video.shape
        per_image = (height // factor) * (width // factor)
        groups = (end - start) // per_image
        if groups * per_image != end - start or groups <= 0 or frames % groups:
            raise ValueError(f"a video of {frames} frames of {height}x{width} does not fill its span of "
                             f"{end - start} tokens in whole images of {per_image} tokens")
        merged = video.reshape(groups, frames // groups, height, width, 3).float().mean(dim=1)
        for g in range(groups):
            images.append(merged[g].round().to(torch.uint8))
            spans.append((start + g * per_image, start + (g + 1) * per_image))
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    return dataclasses.replace(mb, images=[images[i] for i in order],
                               image_spans=torch.tensor([spans[i] for i in order], dtype=torch.int32).reshape(-1, 2),
                               videos=[], video_spans=torch.zeros((0, 2), dtype=torch.int32))
