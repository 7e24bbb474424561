# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Real ``torch.distributed`` ranks for the benchmarks: the same runner the upstream tests carry."""

from tests.distributed.ranks import free_port, results_or_raise, run_ranks

__all__ = ["free_port", "results_or_raise", "run_ranks"]
