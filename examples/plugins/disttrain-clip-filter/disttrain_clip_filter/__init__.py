"""clip_filter: a disttrain sample hook for LAION-style samples (img2dataset's KEY.json).

Leaves out a sample whose CLIP image-text similarity (the JSON's ``similarity``, as img2dataset
writes it from the LAION parquet) is below ``min_score``, or that has none; optionally replaces the
caption by another JSON field (``caption_from``, e.g. a recaptioned ``"caption_long"``).

Parameters: {"min_score": 0.28, "field": "similarity", "caption_from": null}
"""

from __future__ import annotations

import json

from disttrain_api.plugins import Plugin, SampleContext, Skip

PARAMS = {"min_score", "field", "caption_from"}


class ClipScoreFilter(Plugin):
    sample_members = ("json", "txt")  # the images' bytes are not sent to its worker

    def __init__(self, params: dict):
        super().__init__(params)
        unknown = set(params) - PARAMS
        if unknown:
            raise ValueError(f"unknown parameter(s) {sorted(unknown)}; known: {sorted(PARAMS)}")
        self.min_score = params.get("min_score", 0.28)
        if isinstance(self.min_score, bool) or not isinstance(self.min_score, (int, float)) \
                or not -1.0 <= self.min_score <= 1.0:
            raise ValueError(f"min_score must be a number in [-1, 1], got {self.min_score!r}")
        self.field = params.get("field", "similarity")
        self.caption_from = params.get("caption_from")
        for name in ("field", "caption_from"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 128):
                raise ValueError(f"{name} must be a JSON field name of 1-128 characters, got {value!r}")

    def sample(self, members: dict[str, bytes], ctx: SampleContext) -> dict[str, bytes] | None:
        raw = members.get("json")
        if raw is None:
            raise Skip("no json member to read the CLIP score from")
        try:
            meta = json.loads(raw)
        except ValueError as exc:
            raise Skip(f"its json member is not JSON ({exc})") from None
        score = meta.get(self.field) if isinstance(meta, dict) else None
        if isinstance(score, bool) or not isinstance(score, (int, float)):
            raise Skip(f"its json has no numeric {self.field!r}")
        if score < self.min_score:
            raise Skip(f"CLIP score {score:.3f} is below {self.min_score:g}")
        if self.caption_from is None:
            return None
        caption = meta.get(self.caption_from)
        if not isinstance(caption, str) or not caption.strip():
            raise Skip(f"its json has no text {self.caption_from!r} to caption it with")
        return {**members, "txt": caption.encode("utf-8")}
