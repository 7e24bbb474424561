# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""A vLLM-Omni platform for CPU ranks over gloo, for tests only: vLLM-Omni ships none.

It activates only when ``VLLM_OMNI_CPU_TEST_PLATFORM=1`` and torch sees no accelerator; anywhere else
the entry points return nothing and change nothing.
"""

from __future__ import annotations

import os

ENV = "VLLM_OMNI_CPU_TEST_PLATFORM"
PLATFORM = "vllm_omni_cpu_test_platform.platform.CpuTestOmniPlatform"


def requested() -> bool:
    """``VLLM_OMNI_CPU_TEST_PLATFORM``: ``1`` asks for the platform, ``0`` or unset does not; nothing else."""
    value = os.environ.get(ENV, "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not valid; expected '1' (use the CPU test platform) or '0'")
    return value == "1"


def active() -> bool:
    if not requested():
        return False
    import torch

    return not torch.accelerator.is_available()


def activate() -> str | None:
    """``vllm_omni.platform_plugins`` entry point: the platform's qualified name where it applies, else None."""
    return PLATFORM if active() else None
