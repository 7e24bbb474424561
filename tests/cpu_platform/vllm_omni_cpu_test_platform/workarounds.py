# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""``vllm_omni.general_plugins`` entry point: mend what stops MiniMax-H3 on CPU ranks, where the platform is active.

vLLM-Omni loads general plugins in every worker before it builds the pipeline. Each workaround below names
the obstacle it steps around; none of them is needed on an accelerator, and none is applied there.
"""

from __future__ import annotations

import functools
import threading

import torch

from . import active
from .platform import count_empty_cache

_MARK = "_cpu_test_platform_workaround"


def _wrap(owner, name: str, make):
    """Replace ``owner.name`` by ``make(original)`` once per process."""
    original = getattr(owner, name)
    if not getattr(original, _MARK, False):
        wrapper = functools.wraps(original)(make(original))
        setattr(wrapper, _MARK, True)
        setattr(owner, name, wrapper)


def apply() -> None:
    if not active():
        return
    import vllm.model_executor.layers.utils as layer_utils

    from vllm_omni.diffusion.models.minimax_h3 import pipeline_minimax_h3
    from vllm_omni.diffusion.worker import diffusion_worker

    # vLLM's CPU linear layers prepack their weights and delete ``.weight``; the MiniMax-H3 text encoder slices
    # ``qkv_proj.weight`` and ``gate_up_proj.weight`` directly (``minimax_h3/encoder.py``). Keep the weights.
    _wrap(layer_utils, "dispatch_cpu_unquantized_gemm", lambda f: lambda layer, remove_weight: f(layer, False))

    # ``Qwen3VLProcessor.from_pretrained`` builds a video processor that needs torchvision, which does not load
    # beside torch+cpu; the pipeline uses only the processor's ``image_processor`` (PIL works).
    pipeline_minimax_h3.Qwen3VLProcessor = _ImageOnlyProcessor

    # The adapters' offload ends in ``torch.accelerator.empty_cache()``, which raises without an accelerator:
    # count it where an accelerator would release memory, as the platform's own ``empty_cache`` does.
    _wrap(torch.accelerator, "empty_cache", lambda f: lambda: count_empty_cache())

    # The worker's output thread asks ``torch.accelerator.current_accelerator().type`` for a copy stream and
    # dies on None (``diffusion/worker/diffusion_worker.py``): that thread gets "cpu".
    _wrap(torch.accelerator, "current_accelerator", _cpu_for_the_output_thread)

    # Packing outputs into shared memory with a copy stream calls ``torch.accelerator.current_stream()``, which
    # raises on CPU (``diffusion/ipc.py``); without a stream it copies synchronously.
    _wrap(diffusion_worker, "pack_diffusion_output_shm", lambda f: lambda output, d2h_stream=None: f(output))


def _cpu_for_the_output_thread(original):
    def current_accelerator(check_available: bool = False):
        device = original(check_available)
        if device is None and threading.current_thread().name == "DiffusionAsyncOutput":
            return torch.device("cpu")
        return device

    return current_accelerator


class _ImageOnlyProcessor:
    """What the pipeline reads of ``Qwen3VLProcessor``: its image processor (and the merge size on it)."""

    def __init__(self, image_processor) -> None:
        self.image_processor = image_processor

    @classmethod
    def from_pretrained(cls, path, subfolder=None, **kwargs):
        from transformers import Qwen2VLImageProcessor

        return cls(Qwen2VLImageProcessor.from_pretrained(path, subfolder=subfolder, **kwargs))
