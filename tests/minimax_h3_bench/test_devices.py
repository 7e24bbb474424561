# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The benchmark's device-specific corner, as far as it runs without an XPU."""

from __future__ import annotations

import pytest
import torch

from minimax_h3_bench import devices

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


class StandInXpu:
    """Stands in for ``torch.xpu`` (no card here): fixed figures, and a record of the synchronisation."""

    def __init__(self) -> None:
        self.synchronized = []

    def synchronize(self, device):
        self.synchronized.append(device)

    def mem_get_info(self, device):
        return 30 * 2**30, 64 * 2**30  # free, total

    def memory_reserved(self, device):
        return 20 * 2**30

    def memory_allocated(self, device):
        return 12 * 2**30


def test_cpu_uses_gloo_and_has_no_memory_figure():
    assert devices.backend_for("cpu") == "gloo"
    assert devices.rank_device("cpu", 3) == torch.device("cpu")
    assert devices.sample_memory(torch.device("cpu")) is None


def test_xpu_memory_sample_separates_memory_outside_pytorch():
    xpu = StandInXpu()
    sample = devices.sample_memory(torch.device("xpu", 1), module=xpu)
    assert xpu.synchronized == [torch.device("xpu", 1)]
    assert sample.used_bytes == 34 * 2**30 and sample.allocated_bytes == 12 * 2**30
    assert sample.non_pytorch_bytes == 14 * 2**30


@pytest.mark.parametrize("bad", ["cuda", "XPU", ""])
def test_unknown_device_is_an_error_naming_it(bad):
    with pytest.raises(ValueError, match=f"device={bad!r}"):
        devices.backend_for(bad)


@pytest.mark.skipif(torch.distributed.is_xccl_available(), reason="this torch has XCCL")
def test_xpu_without_xccl_or_oneccl_bindings_says_what_to_install():
    with pytest.raises(RuntimeError, match="requirements/xpu.txt"):
        devices.backend_for("xpu")
