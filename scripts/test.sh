#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
#
# Set up the CPU stacks and run every check: lint, the whole suite on vllm-omni 0.28.0 (.venv), and
# the integration tests again on vllm-omni 0.30.0 (.venv-omni-0.30), each with its slowest tests listed (CI's time
# budget is 40 minutes from a clean clone). Extra arguments go to both pytest runs.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

# The two stacks' installs are single-threaded: side by side, each on its own core.
bash scripts/setup_env.sh omni-0.30 & newer=$!
status=0
bash scripts/setup_env.sh || status=$?
wait "$newer" || status=$?
[ "$status" -eq 0 ] || exit "$status"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== set-up and lint: ${SECONDS} s"
echo "== vllm-omni $(.venv/bin/python -c 'from importlib.metadata import version; print(version("vllm-omni"))'): all tests"
.venv/bin/python -m pytest --durations=15 "$@"
echo "== set-up, lint and all tests: ${SECONDS} s"
echo "== vllm-omni $(.venv-omni-0.30/bin/python -c 'from importlib.metadata import version; print(version("vllm-omni"))'): integration tests"
.venv-omni-0.30/bin/python -m pytest -m integration --durations=15 "$@"
echo "== every check: ${SECONDS} s"
