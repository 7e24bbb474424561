# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The CPU test platform: vLLM's CPU platform under vLLM-Omni's interface, gloo, SDPA, one "device" per rank.

``empty_cache()`` is a counted no-op: each call is logged, so a CPU run shows where an accelerator run would
release cached memory (after which the next collective lands on new addresses).
"""

from __future__ import annotations

import itertools
import os

import torch
from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform

from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

logger = init_logger("vllm_omni.cpu_test_platform")

DEVICE_COUNT_ENV = "VLLM_OMNI_CPU_TEST_DEVICE_COUNT"
_empty_cache_calls = itertools.count(1)


def device_count() -> int:
    """``VLLM_OMNI_CPU_TEST_DEVICE_COUNT`` (default 4): vLLM-Omni wants one device per rank and at least one."""
    raw = os.environ.get(DEVICE_COUNT_ENV, "4")
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"{DEVICE_COUNT_ENV}={raw!r} is not valid; expected an integer >= 1")
    return int(raw)


class CpuTestOmniPlatform(OmniPlatform, CpuPlatform):
    _omni_enum = OmniPlatformEnum.OOT
    dist_backend = "gloo"
    # CpuPlatform's variable picks NUMA nodes; vLLM-Omni sets it per stage, so give it a name of its own.
    device_control_env_var = "VLLM_OMNI_CPU_TEST_VISIBLE_DEVICES"

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend, head_size, allow_trtllm_default=False) -> str:
        return "vllm_omni_cpu_test_platform.attention.CpuSDPABackend"

    @classmethod
    def mem_pool_api(cls):
        """``MemPool`` and ``use_mem_pool`` for the request pool: a stand-in, as CPU has no caching allocator."""
        from . import mem_pool

        return mem_pool

    @classmethod
    def get_device_count(cls) -> int:
        return device_count()

    @classmethod
    def get_torch_device(cls, local_rank=None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def empty_cache(cls) -> None:
        logger.info(
            "[CPU_TEST_PLATFORM] empty_cache #%d pid=%d: an accelerator would release cached device memory here",
            next(_empty_cache_calls),
            os.getpid(),
        )

    @classmethod
    def synchronize(cls) -> None:
        pass

    @classmethod
    def reset_peak_memory_stats(cls, device=None) -> None:
        pass

    @classmethod
    def max_memory_allocated(cls, device=None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device=None) -> int:
        return 0

    @classmethod
    def get_free_memory(cls, device=None) -> int:
        return cls.get_device_memory(device)[0]

    @classmethod
    def get_device_memory(cls, device=None) -> tuple[int, int]:
        total = cls.get_device_total_memory()
        return total // 2, total

    @classmethod
    def get_device_version(cls) -> None:
        return None

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        # As XPU answers: vLLM-Omni then compiles the DiT (Inductor, dynamic shapes) unless --enforce-eager.
        return True

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "platforms/cpu_test/stage_configs"  # none: vLLM-Omni falls back to its default stage
