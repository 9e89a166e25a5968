"""Markers follow the folder: a test under tests/integration/ is ``integration`` (real gRPC
servers, redis-server, subprocesses, torchrun: minutes), every other one ``unit`` (in-process,
seconds). ``./dev.sh test -m unit`` runs the fast half; a new test file that starts processes goes
under tests/integration/. Shared test code is tests/helpers.py (this folder is on the import path
because this conftest lives here)."""

import os

import pytest

HEAVY = (
    "tests/integration/test_faults.py::test_short_fault_runs",
    "tests/integration/test_train.py",
    "tests/integration/test_layout_runtime.py",
    "tests/integration/test_benches.py::test_every_bench_runs_quick",
    "tests/integration/test_examples.py",
    "tests/integration/test_bench_train.py",
    "tests/integration/test_install.py",
)
"""The tests that take the most time (``--durations``; torchrun runs, bench runs), longest first.
They start first, dealt across the test processes (pytest-xdist), so that the run ends on short
tests that fill the cores, not on a few long ones in one process while the others idle. A new long
test goes in this list."""


def _deal(heavy: list, light: list, workers: int) -> list:
    """The order that gives each of ``workers`` processes a share of the heavy tests at the head of
    its stretch: ``--dist worksteal`` hands process w the w-th of ``workers`` contiguous stretches
    of the collection (idle processes later take the tail of the longest queue: short tests)."""
    if workers <= 1:
        return heavy + light
    hands: list[list] = [[] for _ in range(workers)]
    for k, item in enumerate(heavy):  # snake order: 0 1 2 3 3 2 1 0 0 1 ...
        row, col = divmod(k, workers)
        hands[col if row % 2 == 0 else workers - 1 - col].append(item)
    out: list = []
    left = len(heavy) + len(light)
    for w in range(workers):
        stretch = left // (workers - w)  # worksteal's split of what is still pending
        take = max(0, stretch - len(hands[w]))
        out += hands[w] + light[:take]
        light = light[take:]
        left -= len(hands[w]) + take
    return out + light


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.integration if "integration" in item.path.parent.parts else pytest.mark.unit)

    def rank(item) -> int:
        return next((i for i, prefix in enumerate(HEAVY) if item.nodeid.startswith(prefix)), len(HEAVY))

    heavy = sorted((item for item in items if rank(item) < len(HEAVY)), key=rank)  # stable: file order within
    light = [item for item in items if rank(item) == len(HEAVY)]
    items[:] = _deal(heavy, light, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
