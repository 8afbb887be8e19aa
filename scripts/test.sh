#!/usr/bin/env bash
# Run the checks and the test suite (sets up first). Extra arguments go to pytest, e.g. scripts/test.sh -k engine
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# the file names and a percentage as it goes, and the slowest tests at the end
exec .venv/bin/python -m pytest -ra --durations=10 "$@"
