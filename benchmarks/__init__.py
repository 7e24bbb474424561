# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The benchmarks, never installed: the operator's A/B on cards (``pipeline_census``), the VAE gather's reproducer,
the request pool's premise, staging's per-call cost, and what they share (paired statistics, tables, device memory)."""
