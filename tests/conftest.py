"""Markers follow the folder: a test under tests/integration/ is ``integration`` (real gRPC
servers, redis-server, subprocesses, torchrun: minutes), every other one ``unit`` (in-process,
seconds). ``./dev.sh test -m unit`` runs the fast half; a new test file that starts processes goes
under tests/integration/. Shared test code is tests/helpers.py (this folder is on the import path
because this conftest lives here)."""

import os

import pytest

# The suite runs several processes per core (pytest-xdist, servers, torchrun ranks): torch's
# intra-op threads would only contend, and spin. One each, here and in every process started
# from here (set before anything imports torch; a user's own setting is kept).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.integration if "integration" in item.path.parent.parts else pytest.mark.unit)
