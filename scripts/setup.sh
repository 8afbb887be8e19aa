#!/usr/bin/env bash
# Set up everything depctl needs, idempotently: a virtualenv in .venv, torch (the CPU build 2.13.0 when no torch
# is installed), depctl itself with its test extras, and the default model in the cache.
#   PYTHON=python3.11 scripts/setup.sh      # pick the interpreter (3.10+)
#   DEPCTL_SKIP_MODEL=1 scripts/setup.sh    # do not fetch the default model
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${DEPCTL_VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating virtualenv $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

if ! "$PY" -c "import torch" 2>/dev/null; then
    # an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is the CPU build these machines have locally.
    # On a GPU machine install the CUDA build of torch into $VENV first and this step is skipped.
    echo "setup: installing torch==2.13.0 (pip lists each package; half a minute to minutes)" >&2
    "$PY" -m pip install --progress-bar off torch==2.13.0 >&2
fi

stamp="$VENV/.depctl-installed"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing depctl and its dependencies (pip lists each; a minute or two the first time)" >&2
    "$PY" -m pip install --progress-bar off -e ".[test]" >&2
    echo "$want" > "$stamp"
fi

if [ -z "${DEPCTL_SKIP_MODEL:-}" ]; then
    "$VENV/bin/depctl" model pull smollm2-135m-instruct
fi
