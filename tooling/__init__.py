# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The project's tooling, never installed: the upstream patch series, ``vllm-omni serve`` on CPU ranks, tiny synthetic
checkpoints of the served pipelines, and the released MiniMax-H3 VAE adapter driven outside a server."""
