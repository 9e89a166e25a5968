#!/usr/bin/env bash
# One entry point for a fresh machine:
#   ./dev.sh run [ARGS...]   set up, then run the main job (embedded default: synthetic LAION shards,
#                            in-process service, 2 trainer-client ranks, one epoch)
#   ./dev.sh test [ARGS...]  set up, then run the test suite (ARGS go to pytest)
#   ./dev.sh setup           only set up
# Any other first word is passed to `python -m preprocess_service` (serve, synth, run ...).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${DISTTRAIN_VENV:-.venv}
PY=${PYTHON:-python3}

setup() {
    # Re-run pip only when pyproject.toml changed since the last successful setup.
    local stamp="$VENV/.disttrain-setup" want
    want=$(sha256sum pyproject.toml | cut -d' ' -f1)
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then return 0; fi
    echo "[setup] creating virtualenv $VENV and installing pinned dependencies (once: about a minute)" >&2
    [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
    # torch first and pinned, so that nothing later can pull the CUDA build.
    "$VENV/bin/python" -m pip install -q "torch==2.13.0" >&2
    "$VENV/bin/python" -m pip install -q -e ".[dev]" >&2
    "$VENV/bin/python" -c "import torch; assert not torch.version.cuda, 'CUDA torch was installed'" >&2
    echo "$want" > "$stamp"
    echo "[setup] done" >&2
}

cmd=${1:-run}
[[ $# -gt 0 ]] && shift
setup
case "$cmd" in
    setup) ;;
    test) exec "$VENV/bin/python" -m pytest "$@" ;;
    *) exec "$VENV/bin/python" -m preprocess_service "$cmd" "$@" ;;
esac
