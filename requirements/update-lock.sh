#!/usr/bin/env bash
# Rewrites requirements/lock.txt: the exact versions dev.sh, CI and the images install, resolved
# from pyproject.toml's ranges (extras service, trainer and dev). Versions already in the lock are
# kept where they still satisfy the ranges (uv prefers them); delete a line to let it move.
# torch is left out (requirements/torch.txt pins it, and the index picks its build: CPU here, CUDA
# on a GPU machine); its dependencies are resolved as for the CPU build (lock-constraints.txt).
#   requirements/update-lock.sh   (from the repository root, after ./dev.sh setup)
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/uv pip compile pyproject.toml --extra service --extra trainer --extra dev \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    -c requirements/lock-constraints.txt --no-emit-package torch --index-strategy unsafe-best-match \
    --index-url https://pypi.org/simple --find-links /opt/wheels \
    --extra-index-url file:///opt/pypi/simple --extra-index-url file:///opt/pypi-more/simple \
    --no-header -o requirements/lock.txt "$@"
{ echo "# Exact versions for dev.sh, CI and the images: written by requirements/update-lock.sh from"
  echo "# pyproject.toml's ranges (torch is in requirements/torch.txt). Do not edit by hand."
  grep -v '^# Exact versions\|^# pyproject.toml.s ranges' requirements/lock.txt; } > requirements/lock.txt.new
mv requirements/lock.txt.new requirements/lock.txt
