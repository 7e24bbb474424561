#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
#
# Serve the tiny synthetic MiniMax-H3 pipeline with `vllm-omni serve` on four CPU ranks (test-only CPU
# platform), send one text-to-video+audio request and print where the gather fix was applied.
# Extra arguments go to tooling.serve_cpu (--output-dir, --prompt).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

bash scripts/setup_env.sh
.venv/bin/python -m tooling.serve_cpu "$@"
