# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Memory samples for the census and the benchmark, as far as they run without an XPU."""

from __future__ import annotations

import pytest
import torch

from xpu_collective_memory import memory

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

    def memory_stats(self, device):
        return {"reserved_bytes.all.peak": 26 * 2**30, "num_alloc_retries": 3}


def test_cpu_has_no_device_figure_and_records_the_process_rss_labelled_as_the_ledgers_cost():
    assert memory.sample_memory(torch.device("cpu")) is None
    record = memory.memory_record(torch.device("cpu"))
    assert set(record) == {"device", "rss_bytes", "label"} and record["device"] == "cpu"
    assert "ledger's pinning" in record["label"] and "not a device figure" in record["label"]
    before = record["rss_bytes"]
    held = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB touched: the RSS is this process's own
    assert memory.process_rss_bytes() - before >= 32 * 2**20
    del held


def test_xpu_stand_in_sample_separates_memory_outside_pytorch_after_a_sync():
    xpu = StandInXpu()
    sample = memory.sample_memory(torch.device("xpu", 1), module=xpu)
    assert xpu.synchronized == [torch.device("xpu", 1)]
    assert sample.used_bytes == 34 * 2**30 and sample.allocated_bytes == 12 * 2**30
    assert sample.non_pytorch_bytes == 14 * 2**30


def test_xpu_stand_in_census_record_has_used_minus_reserved_beside_reserved_and_allocated():
    record = memory.memory_record(torch.device("xpu", 0), module=StandInXpu())
    assert record["device"] == "xpu:0"
    assert (record["non_pytorch_bytes"], record["used_bytes"]) == (14 * 2**30, 34 * 2**30)
    assert (record["reserved_bytes"], record["allocated_bytes"]) == (20 * 2**30, 12 * 2**30)


def test_xpu_stand_in_census_record_has_the_peak_the_retries_and_in_pool_mode_the_pools_segments():
    class Pool:
        def snapshot(self):
            return [{"address": 1 << 40, "total_size": 2**30}, {"address": 1 << 41, "total_size": 2**29}]

    record = memory.memory_record(torch.device("xpu", 0), module=StandInXpu(), pool=Pool())
    assert (record["peak_reserved_bytes"], record["alloc_retries"]) == (26 * 2**30, 3)
    assert (record["pool_segments"], record["pool_bytes"]) == (2, 3 * 2**29)
    assert memory.memory_record(torch.device("xpu", 0), module=StandInXpu())["pool_segments"] == 0
