"""random_resized_crop: a disttrain media hook, torchvision's RandomResizedCrop for encoder images.

Crops a random part of each decoded image (a share ``scale`` of its area, aspect ratio in
``ratio``), resizes it back to the image's planned size (the size its tokens were priced for) and
flips it left-right with probability ``flip``. Random by ``ctx.rng``: the same (seed, key, epoch)
gives the same crop, so a resumed job sees the same pixels.

Parameters: {"scale": [0.5, 1.0], "ratio": [0.75, 1.3333], "flip": 0.5}
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from disttrain_api.plugins import MediaContext, Plugin

PARAMS = {"scale", "ratio", "flip"}


def _pair(params: dict, name: str, default: list, low: float, high: float) -> tuple[float, float]:
    value = params.get(name, default)
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value)
            and low <= value[0] <= value[1] <= high):
        raise ValueError(f"{name} must be [min, max] with {low} <= min <= max <= {high}, got {value!r}")
    return float(value[0]), float(value[1])


class RandomResizedCrop(Plugin):
    media_kinds = ("image",)

    def __init__(self, params: dict):
        super().__init__(params)
        unknown = set(params) - PARAMS
        if unknown:
            raise ValueError(f"unknown parameter(s) {sorted(unknown)}; known: {sorted(PARAMS)}")
        self.scale = _pair(params, "scale", [0.5, 1.0], 0.01, 1.0)
        self.ratio = _pair(params, "ratio", [3 / 4, 4 / 3], 0.1, 10.0)
        self.flip = params.get("flip", 0.5)
        if isinstance(self.flip, bool) or not isinstance(self.flip, (int, float)) or not 0 <= self.flip <= 1:
            raise ValueError(f"flip must be a probability in [0, 1], got {self.flip!r}")

    def media(self, kind: str, array: np.ndarray, ctx: MediaContext) -> None:
        height, width = array.shape[:2]
        top, left, h, w = self._box(height, width, ctx.rng)
        crop = Image.fromarray(np.ascontiguousarray(array[top:top + h, left:left + w]))
        out = np.asarray(crop.resize((width, height), Image.Resampling.BILINEAR))
        if ctx.rng.random() < self.flip:
            out = out[:, ::-1]
        array[...] = out

    def _box(self, height: int, width: int, rng) -> tuple[int, int, int, int]:
        """torchvision's sampling: ten tries at a box of the drawn area and ratio, else the centre."""
        area = height * width
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
        return 0, 0, height, width
