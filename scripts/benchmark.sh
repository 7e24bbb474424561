#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
#
# Set up the CPU stack and run the main job. Extra arguments go to the benchmark.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

bash scripts/setup_env.sh
.venv/bin/python -m benchmarks.minimax_h3_vae_gather "$@"
