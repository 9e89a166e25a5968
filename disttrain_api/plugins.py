"""What an operator's plugin implements: processing the service runs on a job's samples.

A plugin is a class an installed Python package registers under the entry-point group
``disttrain.plugins``; the entry point's name is the plugin's name, which jobs give in
``JobConfig.plugins`` with JSON parameters. A job never sends code: the service refuses a name it
has not registered. Hook order for every sample (docs/plugins.md):

    read (raw members) -> sample hooks, in the job's order -> parse and price -> plan
    -> decode each media item -> media hooks, in the job's order -> the microbatch

``sample(members, ctx)`` sees a sample's raw members (``"txt"``, ``"json"``, ``"jpg"``,
``"1.png"`` ... -> bytes). It returns the members to parse instead (text and JSON members changed,
added or removed; media members removed, never changed or added), None to keep them, or raises
``Skip(reason)``. ``media(kind, array, ctx)`` sees one decoded item (``"image"``: uint8 [h, w, 3];
``"audio"``: float16 [frames, n_mels]; ``"gen"``: uint8 [size, size, 3]) and changes it in place or
returns an array of the same shape and dtype. Both are deterministic per (job seed, sample key,
epoch): ``ctx.rng`` is seeded from them, so a resumed or re-decoded sample is the same. Hooks run in
the service's worker processes under a time limit and a memory budget per sample; a hook that
raises, hangs or leaks fails its sample (reported with its key), not the job.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

ENTRY_POINT_GROUP = "disttrain.plugins"
"""The entry-point group plugins are registered under (``[project.entry-points."disttrain.plugins"]``)."""


class Skip(Exception):
    """Raised by a sample hook: leave this sample out, reported with ``reason`` (kind "filtered")."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def rng_seed(seed: int, key: str, epoch: int, plugin: str, member: str = "") -> list[int]:
    """The entropy of a hook's generator: a function of the job seed, the sample key, the epoch,
    the plugin's name and the member, nothing else (not the worker, the time or the order)."""
    digest = hashlib.blake2b(f"{key}\0{plugin}\0{member}".encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return [seed, epoch, *(int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4))]


@dataclass(frozen=True, slots=True)
class SampleContext:
    """What a sample hook knows besides the members."""

    key: str
    """The sample's key (``__key__``)."""
    url: str
    """Its shard."""
    seed: int
    """The job's seed."""
    epoch: int
    """The epoch it is read for."""
    rng: Any = field(repr=False)
    """A numpy Generator seeded from (seed, key, epoch, plugin name)."""


@dataclass(frozen=True, slots=True)
class MediaContext:
    """What a media hook knows besides the array."""

    key: str
    """The sample's key."""
    member: str
    """The member the item was decoded from (``"jpg"``, ``"1.png"``, ``"flac"``)."""
    seed: int
    epoch: int
    rng: Any = field(repr=False)
    """A numpy Generator seeded from (seed, key, epoch, plugin name, member)."""


class Plugin:
    """Base class of a plugin. ``__init__(params)`` gets the job's JSON parameters (a dict) and
    raises ValueError on a bad one (the job is refused with that message). Override ``sample``,
    ``media`` or both; the service calls only what a subclass overrides."""

    media_kinds: tuple[str, ...] = ("image",)
    """The media kinds ``media`` is called for."""
    sample_members: tuple[str, ...] | None = None
    """The member extensions ``sample`` reads (e.g. ``("json", "txt")``: ``"1.txt"`` counts as
    ``"txt"``); the others are not sent to its worker (and it cannot drop them). None: every
    member, the media's bytes too."""

    def __init__(self, params: dict):
        self.params = params

    def sample(self, members: dict[str, bytes], ctx: SampleContext) -> dict[str, bytes] | None:
        """The sample hook (see the module docstring)."""
        return None

    def media(self, kind: str, array, ctx: MediaContext):
        """The media hook (see the module docstring)."""
        return None

    @classmethod
    def has_sample_hook(cls) -> bool:
        return cls.sample is not Plugin.sample

    @classmethod
    def has_media_hook(cls) -> bool:
        return cls.media is not Plugin.media
