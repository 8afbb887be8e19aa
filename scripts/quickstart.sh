#!/usr/bin/env bash
# The main job: set up, start the daemon, deploy the default model with n-gram speculation, send a request,
# print the answer, the deployment's state and the speedup over the same model without speculation.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/quickstart.py "$@"
