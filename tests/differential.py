"""Differential testing: a whole run's microbatches as {sample key: what the trainer got for that
sample}, and one comparison that names the first key and field where two runs differ.

Two routes to the same data (another dp size, a replica, a format, a plugin that changes nothing)
may pack and order samples differently, so runs are compared per sample, never per microbatch. A
sample is one segment of ``cu_seqlens`` (``segment_doc`` names its entry of ``sample_keys``; the
packer never splits a document across sequences), so its record is its slice of every [S, L] array
plus each of its media items with the item's token span counted from the sample's first token."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from trainer import DataClient
from trainer.client import next_position

TOKEN_FIELDS = ("tokens", "position_ids", "modality", "loss_mask", "labels")
"""[S, L] arrays of a microbatch, cut per sample: always compared exactly."""
MEDIA = {"image": ("image_spans", "images"), "audio": ("audio_spans", "mels"),
         "gen": ("gen_spans", "gen_images"), "video": ("video_spans", "videos")}
"""Media kind -> (its spans field, its arrays field) in trainer.Microbatch."""


@dataclass(eq=False)
class SampleRecord:
    """What one sample delivered: its token arrays (1-D, its segment) and, per media kind, its
    items as (span relative to its first token, array), in span order."""

    arrays: dict[str, np.ndarray]
    media: dict[str, list[tuple[tuple[int, int], np.ndarray]]]
    dataset: int | None


@dataclass(eq=False)
class RunRecord:
    """A whole run per sample: delivered samples by key and skipped keys with their (kind, reason)s."""

    samples: dict[str, SampleRecord] = field(default_factory=dict)
    skipped: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)


def per_sample(microbatches: Iterable, skipped: Iterable = (), *, key: Callable[[str], str] = str) -> RunRecord:
    """The run's microbatches (trainer.Microbatch, any order, any ranks) and the skipped records of
    its job reports (anything with key, kind, reason) as one RunRecord; ``key`` maps a sample key to
    the one compared (another format's keys). AssertionError for a sample delivered twice, or one a
    microbatch reports skipped (a failed decode) that the reports do not."""
    run, in_microbatches = RunRecord(), set()
    for mb in microbatches:
        for name, record in _samples_of(mb):
            name = key(name)
            assert name not in run.samples, f"sample {name!r} was delivered twice (again at step {mb.step})"
            run.samples[name] = record
        in_microbatches.update((key(name), reason) for name, _, reason in mb.skipped)
    reasons: dict[str, set[tuple[str, str]]] = {}
    for record in skipped:
        reasons.setdefault(key(record.key), set()).add((record.kind, record.reason))
    run.skipped = {name: tuple(sorted(pairs)) for name, pairs in reasons.items()}
    reported = {(name, reason) for name, pairs in reasons.items() for _, reason in pairs}
    missing = in_microbatches - reported
    assert not missing, f"skipped in a microbatch, not in the report: {missing}"
    return run


def _samples_of(mb) -> Iterable[tuple[str, SampleRecord]]:
    flat = {name: getattr(mb, name).numpy().reshape(-1) for name in TOKEN_FIELDS}
    bounds = mb.cu_seqlens.numpy()
    owners = mb.segment_doc.numpy()
    items = {kind: _items(getattr(mb, spans).numpy(), getattr(mb, arrays), bounds)
             for kind, (spans, arrays) in MEDIA.items()}
    datasets = list(mb.sample_datasets)
    for segment, doc in enumerate(owners.tolist()):
        if doc < 0:  # a sequence's padding tail
            continue
        start, end = int(bounds[segment]), int(bounds[segment + 1])
        media = {kind: [((s - start, e - start), array) for s, e, owner, array in found if owner == segment]
                 for kind, found in items.items()}
        yield mb.sample_keys[doc], SampleRecord(
            arrays={name: array[start:end].copy() for name, array in flat.items()}, media=media,
            dataset=datasets[doc] if datasets else None)


def _items(spans: np.ndarray, arrays, bounds: np.ndarray) -> list[tuple[int, int, int, np.ndarray]]:
    """(start, end, owning segment, array copy) of each media item of one kind."""
    owners = np.searchsorted(bounds, spans[:, 0], side="right") - 1 if len(spans) else []
    return [(int(s), int(e), int(o), a.numpy().copy()) for (s, e), o, a in zip(spans.tolist(), owners, arrays)]


def assert_same(a: RunRecord, b: RunRecord, tol: dict[str, float] | None = None) -> dict[str, float]:
    """AssertionError naming the first differing key and field, unless ``a`` and ``b`` delivered the
    same keys with the same content and skipped the same keys for the same (kind, reason)s. Token
    arrays, spans and shapes must be equal; a media kind's values may differ by ``tol[kind]`` (absolute,
    default 0: exactly equal). Returns the largest deviation seen per media kind (0.0 where identical)."""
    tol = tol or {}
    _same_keys("delivered", a.samples, b.samples)
    _same_keys("skipped", a.skipped, b.skipped)
    worst = dict.fromkeys(MEDIA, 0.0)
    for key in sorted(a.skipped):
        assert a.skipped[key] == b.skipped[key], f"skipped {key!r}: (kind, reason) {a.skipped[key]} != {b.skipped[key]}"
    for key in sorted(a.samples):
        x, y = a.samples[key], b.samples[key]
        for name in TOKEN_FIELDS:
            _equal(key, name, x.arrays[name], y.arrays[name])
        assert x.dataset == y.dataset, f"sample {key!r}: dataset {x.dataset} != {y.dataset}"
        for kind in MEDIA:
            xs, ys = x.media[kind], y.media[kind]
            assert [s for s, _ in xs] == [s for s, _ in ys], \
                f"sample {key!r}: {kind} spans {[s for s, _ in xs]} != {[s for s, _ in ys]}"
            for i, ((_, p), (_, q)) in enumerate(zip(xs, ys)):
                assert p.shape == q.shape, f"sample {key!r}: {kind} {i} has shape {p.shape} != {q.shape}"
                deviation = _deviation(p, q)
                worst[kind] = max(worst[kind], deviation)
                assert deviation <= tol.get(kind, 0.0), (
                    f"sample {key!r}: {kind} {i} differs by up to {deviation} (tolerance {tol.get(kind, 0.0)}) "
                    f"at {tuple(int(i) for i in np.unravel_index(np.argmax(_abs_diff(p, q)), p.shape))}")
    return worst


def _same_keys(what: str, a: dict, b: dict) -> None:
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    assert not only_a and not only_b, (f"{what} keys differ: first {(only_a + only_b)[0]!r}; only in the first run "
                                       f"{only_a[:5]} ({len(only_a)}), only in the second {only_b[:5]} ({len(only_b)})")


def _equal(key: str, name: str, x: np.ndarray, y: np.ndarray) -> None:
    if x.shape != y.shape:
        raise AssertionError(f"sample {key!r}: {name} has {x.shape[0]} positions != {y.shape[0]}")
    wrong = np.flatnonzero(x != y)
    assert not wrong.size, (f"sample {key!r}: {name} differs at {wrong.size} positions, first at {wrong[0]}: "
                            f"{x[wrong[0]]} != {y[wrong[0]]}")


def _abs_diff(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    p64, q64 = p.astype(np.float64), q.astype(np.float64)
    same = (p64 == q64) | (np.isnan(p64) & np.isnan(q64))  # equal infinities (log of silence) are equal
    return np.where(same, 0.0, np.abs(p64 - q64))


def _deviation(p: np.ndarray, q: np.ndarray) -> float:
    return 0.0 if np.array_equal(p, q) else float(_abs_diff(p, q).max())


def summary(deviations: dict[str, float], run: RunRecord) -> str:
    """One line for the closing note: identical, or the largest deviation per media kind (and the
    skip reasons that differed only in an object address)."""
    counts = {kind: sum(len(r.media[kind]) for r in run.samples.values()) for kind in MEDIA}
    kinds = ", ".join(f"{kind} {counts[kind]}" for kind in MEDIA if counts[kind])
    head = f"{len(run.samples)} samples ({kinds}), {len(run.skipped)} skipped"
    off = {kind: d for kind, d in deviations.items() if d}
    return f"{head}: " + ("identical" if not off else "differs: " + ", ".join(
        f"{kind} {d:g}" for kind, d in off.items()))


# --- consuming a run ------------------------------------------------------------------------------
class Consumed(NamedTuple):
    microbatches: list
    """Every rank's microbatches, rank after rank."""
    states: dict[int, dict]
    """Each rank's DataClient state where it stopped."""
    skipped: list
    """The job report's skipped records once every rank was done."""
    num_shared_memory: int
    """Microbatches that came in shared memory, all ranks together."""


def consume(addresses, config, *, ranks: Iterable[int] | None = None, shared_memory: bool = True,
            states: dict[int, dict] | None = None, until: Callable | None = None,
            acknowledge: bool = False) -> Consumed:
    """Every rank of ``config`` (or ``ranks``) in its own thread, as trainer workers read (from
    ``addresses``, or its own entry of it where it is a dict rank -> addresses): each from
    its ``states`` entry if given, to the end or until ``until(rank, position, count)`` is true
    after a microbatch (position: the rank's next (step, microbatch); count: its microbatches so
    far). ``acknowledge``: each rank acknowledges where it stopped, as a trainer does once its
    checkpoint is durable."""
    out: dict[int, list] = {}
    saved: dict[int, dict] = {}
    errors: list[Exception] = []
    shared = []
    ranks = list(range(config.dp_size) if ranks is None else ranks)

    def body(rank):
        try:
            where = addresses[rank] if isinstance(addresses, dict) else addresses
            with DataClient(where, config, rank, prefetch=2, shared_memory=shared_memory) as client:
                if states and rank in states:
                    client.load_state_dict(states[rank])
                out[rank] = []
                for mb in client:
                    out[rank].append(mb)
                    if until is not None and until(rank, next_position(mb), len(out[rank])):
                        break
                saved[rank] = client.state_dict()
                shared.append(client.num_shared_memory)
                if acknowledge:
                    client.acknowledge()
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors
    where = addresses[ranks[0]] if isinstance(addresses, dict) else addresses
    with DataClient(where, config, ranks[0]) as client:  # opens the job the ranks read: no stream
        skipped = list(client.report().skipped)
    return Consumed([mb for rank in sorted(out) for mb in out[rank]], saved, skipped, sum(shared))
