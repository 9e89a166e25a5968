"""Where a client resumes after a microbatch (found by bench/faults.py: a stream broken right after
a step every rank acknowledged resumed at (step, M), a position whose plan the service had dropped)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainer.client import next_position


@pytest.mark.parametrize(("step", "index", "num", "expected"), [
    (6, 0, 2, (6, 1)), (6, 1, 2, (7, 0)), (0, 0, 1, (1, 0)), (3, 4, 4, (4, 0))])
def test_after_a_step_s_last_microbatch_the_position_is_the_next_step(step, index, num, expected):
    assert next_position(SimpleNamespace(step=step, microbatch_index=index, num_microbatches=num)) == expected
