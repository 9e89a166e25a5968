#!/usr/bin/env bash
# One entry point for a fresh machine:
#   ./dev.sh run [ARGS...]   set up, then run the main job (embedded default: synthetic LAION shards,
#                            in-process service, 2 trainer-client ranks, one epoch)
#   ./dev.sh test [ARGS...]  set up, then check the layer contracts and run the test suite (ARGS go to pytest)
#   ./dev.sh setup           only set up
# Any other first word is passed to `python -m disttrain_tools` (serve, synth, run ...).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${DISTTRAIN_VENV:-.venv}
PY=${PYTHON:-python3}

setup() {
    # Re-run pip only when pyproject.toml changed since the last successful setup.
    local stamp="$VENV/.disttrain-setup" want
    want=$(cat pyproject.toml dev.sh requirements/torch.txt requirements/lock.txt | sha256sum | cut -d' ' -f1)
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then return 0; fi
    echo "[setup] creating virtualenv $VENV and installing the locked dependencies (once: about a minute)" >&2
    [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
    # torch at the locked version (the index picks its build: CPU here, CUDA on a GPU machine) and
    # everything else at the lock's exact versions, by two pips at once (disjoint packages: --no-deps;
    # faster than one after the other), then once more with their dependencies: nothing to do here, a CUDA
    # build's own libraries on a GPU machine. (Compiled to bytecode, as pip does by default: where
    # PYTHONDONTWRITEBYTECODE is set, as here, a module left uncompiled is compiled again by every
    # process that imports it.) This project goes on top without resolving again.
    "$VENV/bin/python" -m pip install -q --no-deps -r requirements/torch.txt >&2 &
    local torch_pip=$!
    "$VENV/bin/python" -m pip install -q --no-deps -r requirements/lock.txt >&2
    wait "$torch_pip"
    "$VENV/bin/python" -m pip install -q -r requirements/torch.txt -r requirements/lock.txt >&2
    "$VENV/bin/python" -m pip install -q --no-deps -e . >&2
    echo "$want" > "$stamp"
    echo "[setup] done" >&2
}

ensure_redis() {
    # The tests start their own redis-server and nginx (Debian packages) on free ports: the multi-replica
    # tests and the remote-shard tests (tests/webservers.py); the single-node run needs neither.
    local missing=()
    command -v redis-server >/dev/null || missing+=(redis-server)
    command -v nginx >/dev/null || [[ -x /usr/sbin/nginx ]] || missing+=(nginx-light)
    [[ ${#missing[@]} -eq 0 ]] && return 0
    echo "[setup] installing ${missing[*]} (Debian packages, for the multi-replica and remote-shard tests)" >&2
    local sudo=""
    [[ $(id -u) -ne 0 ]] && sudo="sudo"
    $sudo apt-get update -qq >&2
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

ensure_compose() {
    # docker-compose 1.29.2 validates docker/compose.yaml offline (no Docker engine here). It pins
    # jsonschema < 4 and needs PyYAML 5.4.1 built without isolation, so it gets its own venv.
    local venv=.venv-compose
    [[ -x "$venv/bin/docker-compose" ]] && return 0
    echo "[setup] installing docker-compose 1.29.2 into $venv (to validate docker/compose.yaml)" >&2
    "$PY" -m venv "$venv"
    "$venv/bin/python" -m pip install -q "cython<3" wheel setuptools >&2
    "$venv/bin/python" -m pip install -q --no-build-isolation pyyaml==5.4.1 >&2
    "$venv/bin/python" -m pip install -q docker-compose==1.29.2 >&2
}

cmd=${1:-run}
[[ $# -gt 0 ]] && shift
compose=""
if [[ "$cmd" == setup || "$cmd" == test ]]; then ensure_compose & compose=$!; fi  # beside the main setup
setup
case "$cmd" in
    setup) ensure_redis; wait "$compose" ;;
    test) ensure_redis; wait "$compose"
          echo "[test] lint and types (ruff, mypy: pyproject.toml [tool.ruff], [tool.mypy])" >&2
          "$VENV/bin/ruff" check . >&2
          "$VENV/bin/mypy" >&2
          echo "[test] layer contracts (lint-imports, pyproject.toml [tool.importlinter])" >&2
          "$VENV/bin/lint-imports" --no-cache >&2
          # the repository's modules compiled once: the suite starts hundreds of Python processes
          # (servers, torchrun ranks, CLI runs), each of which would otherwise compile what it imports
          # from source where PYTHONDONTWRITEBYTECODE is set
          "$VENV/bin/python" -m compileall -q -j 0 disttrain_api preprocess_service trainer disttrain_tools \
              bench examples tests >/dev/null
          # in 4 processes (pytest-xdist; most tests wait on subprocesses, sockets and Redis, so more
          # than the cores); the 15 slowest tests printed at the end. ARGS come after, so `-n 0` runs
          # it in one process and `-n 8` in more.
          exec "$VENV/bin/python" -m pytest -n "${DISTTRAIN_TEST_PROCESSES:-4}" --durations=15 "$@" ;;
    run) exec "$VENV/bin/python" -m disttrain_tools run --dp-size 2 "$@" ;;  # the demo: 2 client ranks
    *) exec "$VENV/bin/python" -m disttrain_tools "$cmd" "$@" ;;
esac
