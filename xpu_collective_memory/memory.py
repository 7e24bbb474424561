# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Memory samples that show where oneCCL's registrations go: device memory outside PyTorch, or on CPU the RSS."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

CPU_LABEL = "process RSS on CPU ranks: what the ledger's pinning (its model of oneCCL) costs, not a device figure"


@dataclass(frozen=True)
class MemorySample:
    used_bytes: int  # what the driver reports in use on the card
    reserved_bytes: int  # held by PyTorch's caching allocator
    allocated_bytes: int  # in live PyTorch tensors

    @property
    def non_pytorch_bytes(self) -> int:
        """Device memory in use outside PyTorch's allocator: where oneCCL's registrations show up."""
        return self.used_bytes - self.reserved_bytes


def sample_memory(device: torch.device, module: Any = None) -> MemorySample | None:
    """Device memory after the device is idle; ``None`` on CPU, which has no such figure."""
    if device.type == "cpu":
        return None
    module = module if module is not None else torch.get_device_module(device.type)
    module.synchronize(device)
    free, total = module.mem_get_info(device)
    return MemorySample(total - free, module.memory_reserved(device), module.memory_allocated(device))


def process_rss_bytes() -> int:
    """This process's resident memory, from ``/proc/self/statm`` (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_record(device: torch.device, module: Any = None, pool: Any = None) -> dict[str, Any]:
    """One census sample: on a device, used minus reserved beside reserved and allocated, the allocator's peak
    reserved and its retries after a failed allocation, and in the request pool the pool's segments; on CPU, the RSS."""
    sample = sample_memory(device, module)
    if sample is None:
        return {"device": "cpu", "rss_bytes": process_rss_bytes(), "label": CPU_LABEL}
    module = module if module is not None else torch.get_device_module(device.type)
    stats = module.memory_stats(device)
    segments = pool.snapshot() if pool is not None else []
    return {
        "device": str(device),
        "non_pytorch_bytes": sample.non_pytorch_bytes,
        "used_bytes": sample.used_bytes,
        "reserved_bytes": sample.reserved_bytes,
        "allocated_bytes": sample.allocated_bytes,
        "peak_reserved_bytes": stats.get("reserved_bytes.all.peak", 0),
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "pool_segments": len(segments),
        "pool_bytes": sum(segment["total_size"] for segment in segments),
        "label": "device memory in use outside PyTorch's allocator (driver used minus memory_reserved())",
    }
