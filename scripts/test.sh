#!/usr/bin/env bash
# Set up, then run the checks (ruff) and the tests. Two tiers:
#   scripts/test.sh          the fast tier: logic and exactness on tiny models, in-process (a few minutes)
#   scripts/test.sh --all    every tier: also compiles and builds, daemons in subprocesses, real models, training,
#                            installs and the chaos run (what CI runs; tests/engines' vLLM with DEPCTL_TEST_VLLM=1)
# Extra arguments go to pytest, e.g. scripts/test.sh -k engine, or scripts/test.sh --all tests/runtime/api
set -euo pipefail
cd "$(dirname "$0")/.."
tier="fast"
select=(-m "not slow")
if [ "${1:-}" = "--all" ]; then
    shift
    tier="all"
    select=()
fi
scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
start=$SECONDS
status=0
# the slowest tests at the end, then the tier's time
.venv/bin/python -m pytest -ra --durations=10 "${select[@]}" "$@" || status=$?
elapsed=$((SECONDS - start))
echo "scripts/test.sh: the ${tier} tier took $((elapsed / 60))m$((elapsed % 60))s (exit status ${status})"
exit $status
