# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Everything device-specific the benchmark does: the backend, each rank's device, and device-memory samples."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

SUPPORTED = ("cpu", "xpu")


def check_device(device: str) -> str:
    if device not in SUPPORTED:
        raise ValueError(f"device={device!r}: expected one of {SUPPORTED}")
    return device


def backend_for(device: str) -> str:
    """gloo on CPU; on XPU torch's built-in XCCL where present, else oneCCL's bindings (``ccl``)."""
    if check_device(device) == "cpu":
        return "gloo"
    if getattr(dist, "is_xccl_available", lambda: False)():
        return "xccl"
    try:
        importlib.import_module("oneccl_bindings_for_pytorch")  # registers the "ccl" backend
    except ImportError as exc:
        raise RuntimeError(
            "--device xpu needs torch with XCCL (torch.distributed.is_xccl_available()) or "
            "oneccl-bindings-for-pytorch; see requirements/xpu.txt"
        ) from exc
    return "ccl"


def rank_device(device: str, rank: int) -> torch.device:
    """One rank per card: rank r drives ``xpu:r``."""
    if check_device(device) == "cpu":
        return torch.device("cpu")
    count = torch.xpu.device_count()
    if rank >= count:
        raise RuntimeError(f"rank {rank} needs xpu:{rank} but this machine has {count} XPU device(s)")
    torch.xpu.set_device(rank)
    return torch.device("xpu", rank)


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
