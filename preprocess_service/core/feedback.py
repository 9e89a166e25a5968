"""Online refit of the cost model from the stage times trainers measure (opt-in: JobSpec.cost_feedback).

An observation is one microbatch: the forward + backward seconds a trainer measured for each
module, and the features the cost model prices it by (cost.py): for the encoder the sums of t and
t^2 over its images and clips (t their tokens), for the backbone the sums of n and n^2 over its
documents, for the generator the number of images to generate. Over the last ``window``
observations each module is refit by non-negative least squares (cost.fit_nonnegative) as
forward seconds = measured / (1 + backward factor); the backward factors stay as configured. A
module is refit once ``min_observations`` of them have non-zero features; until then its
coefficients stay as they were. Steps planned after a refit are priced with the new coefficients.

A trainer that does not time each module (a monolithic model under DDP or FSDP: one forward and
backward over the whole microbatch) reports the microbatch's total seconds instead. Those
observations fit every coefficient no per-module observation fits, jointly: total = sum over
modules of (1 + backward factor) x the module's forward model, by the same non-negative least
squares (a coefficient whose feature is zero in every observation keeps its value).
"""

from __future__ import annotations

import collections
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from disttrain_api.config import CostConfig
from preprocess_service.core import modalities
from preprocess_service.core.cost import fit_nonnegative

MODULES = ("encoder", "backbone", "generator")

Features = tuple[tuple[float, float], tuple[float, float], tuple[float]]
"""(encoder sum t, sum t^2), (backbone sum n, sum n^2), (images to generate,)."""


@dataclass(frozen=True, slots=True)
class Observation:
    features: Features
    """(encoder sum t, sum t^2), (backbone sum n, sum n^2), (images to generate,)."""
    seconds: tuple[float, float, float]
    """Measured forward + backward seconds of encoder, backbone, generator (0 where not timed)."""
    total: float = 0.0
    """Measured forward + backward seconds of the whole microbatch, for trainers that do not time
    each module (the module seconds are then 0)."""


def microbatch_features(sequences) -> tuple:
    """The cost-model features of a microbatch's packed sequences (Documents)."""
    enc = [t for seq in sequences for doc in seq.documents for t in modalities.encoder_tokens(doc)]
    lengths = [doc.num_tokens for seq in sequences for doc in seq.documents]
    gen = sum(modalities.num_generated(doc) for seq in sequences for doc in seq.documents)
    return ((float(sum(enc)), float(sum(t * t for t in enc))),
            (float(sum(lengths)), float(sum(n * n for n in lengths))), (float(gen),))


REFIT_FIELDS = ("enc_linear_s", "enc_quadratic_s", "bb_linear_s", "bb_quadratic_s", "gen_per_image_s")
"""The coefficients a refit changes."""


def sum_features(rows) -> tuple:
    """Features of several sequences (each as microbatch_features gives them, or its JSON lists) summed."""
    rows = list(rows)
    return tuple(tuple(float(sum(r[m][i] for r in rows)) for i in range(width)) for m, width in enumerate((2, 2, 1)))


def observation_json(observation: Observation) -> str:
    row: dict[str, Any] = {"f": observation.features, "s": observation.seconds}
    if observation.total:
        row["t"] = observation.total
    return json.dumps(row)


def observation_from_json(data: bytes | str) -> Observation:
    row = json.loads(data)
    return Observation(cast(Features, tuple(tuple(f) for f in row["f"])), tuple(row["s"]), float(row.get("t", 0.0)))


class CostRefitter:
    def __init__(self, base: CostConfig, *, window: int = 256, min_observations: int = 8):
        self.cost = base
        self.window = window
        self.min_observations = min_observations
        self._observations: collections.deque[Observation] = collections.deque(maxlen=window)
        self.num_observations = 0
        self.errors: dict[str, float] = {}
        """Mean relative error of each module's last fit on its observations."""

    def add(self, observation: Observation) -> None:
        self._observations.append(observation)
        self.num_observations += 1

    def refit(self) -> CostConfig:
        """The coefficients after fitting the window (unchanged for modules without enough data)."""
        cost = self.cost
        backward = (0.0 if cost.enc_frozen else cost.enc_backward_factor, cost.bb_backward_factor,
                    cost.gen_backward_factor)
        names = (REFIT_FIELDS[0:2], REFIT_FIELDS[2:4], REFIT_FIELDS[4:])
        updates: dict[str, Any] = {}
        fitted = []
        for module, (label, fields) in enumerate(zip(MODULES, names)):
            rows = [(o.features[module], o.seconds[module] / (1 + backward[module])) for o in self._observations
                    if any(o.features[module]) and o.seconds[module] > 0]
            if len(rows) < self.min_observations:
                continue
            fit = fit_nonnegative(np.array([f for f, _ in rows]), np.array([s for _, s in rows]))
            updates.update(dict(zip(fields, (float(c) for c in fit.coef))))
            self.errors[label] = fit.mean_rel_error
            fitted.append(module)
        self.cost = dataclasses.replace(cost, **updates)
        self._refit_totals(backward, fitted)
        return self.cost

    def _refit_totals(self, backward: tuple[float, float, float], fitted: list[int]) -> None:
        """The coefficients of modules without their own observations, fit jointly to the totals
        (less what the modules fitted on their own predict)."""
        totals = [o for o in self._observations if o.total > 0]
        if len(totals) < self.min_observations or len(fitted) == len(MODULES):
            return
        columns = [(module, index) for module, width in enumerate((2, 2, 1)) if module not in fitted
                   for index in range(width) if any(o.features[module][index] for o in totals)]
        if not columns:
            return
        known = np.array([sum(self._module_seconds(o.features, m, backward) for m in fitted) for o in totals])
        target = np.array([o.total for o in totals]) - known
        keep = target > 0.01 * np.array([o.total for o in totals])  # what the modules fitted leave of a total
        if keep.sum() < self.min_observations:
            return
        features = np.array([[o.features[m][i] * (1 + backward[m]) for m, i in columns] for o in totals])[keep]
        try:
            fit = fit_nonnegative(features, target[keep])
        except np.linalg.LinAlgError:  # degenerate observations: keep the coefficients
            return
        fields = {(m, i): REFIT_FIELDS[(0, 2, 4)[m] + i] for m, i in columns}
        updates: dict[str, Any] = {fields[c]: float(v) for c, v in zip(columns, fit.coef)}
        self.cost = dataclasses.replace(self.cost, **updates)
        self.errors["total"] = fit.mean_rel_error

    def _module_seconds(self, features: Features, module: int, backward: tuple[float, float, float]) -> float:
        """Forward + backward seconds the current coefficients give ``module`` for ``features``."""
        names = (REFIT_FIELDS[0:2], REFIT_FIELDS[2:4], REFIT_FIELDS[4:])[module]
        coefficients = [getattr(self.cost, name) for name in names]
        return float(np.dot(coefficients, features[module])) * (1 + backward[module])
