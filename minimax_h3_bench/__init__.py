# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The reproducer's and tests' tooling, never installed: synthetic checkpoints, rank spawning, the released
adapter's harness, the compared strategies, device memory, and ``vllm-omni serve`` on CPU ranks."""
