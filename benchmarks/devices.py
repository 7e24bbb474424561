# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Everything device-specific the VAE gather benchmark does: the backend, each rank's device, memory samples."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from xpu_collective_memory.memory import MemorySample, sample_memory

__all__ = ["SUPPORTED", "MemorySample", "backend_for", "check_device", "rank_device", "sample_memory"]

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
