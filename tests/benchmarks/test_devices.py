# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The benchmark's device-specific corner, as far as it runs without an XPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks import devices

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


def test_cpu_uses_gloo_and_its_own_device():
    assert devices.backend_for("cpu") == "gloo"
    assert devices.rank_device("cpu", 3) == torch.device("cpu")
