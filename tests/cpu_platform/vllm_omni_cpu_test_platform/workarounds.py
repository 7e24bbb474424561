# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""``vllm_omni.general_plugins`` entry point: mend what stops MiniMax-H3 on CPU ranks, where the platform is active.

vLLM-Omni loads general plugins in every worker before it builds the pipeline. Each workaround below names
the obstacle it steps around; none of them is needed on an accelerator, and none is applied there.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch

from . import active

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
    _import_wan2_2_without_torchvision()
    import vllm.model_executor.layers.utils as layer_utils

    from vllm_omni.diffusion.attention.backends.ring import ring_kernels
    from vllm_omni.diffusion.models.minimax_h3 import pipeline_minimax_h3
    from vllm_omni.diffusion.offloader.sequential_backend import SequentialOffloadHook
    from vllm_omni.diffusion.worker import diffusion_worker

    # vLLM's CPU linear layers prepack their weights and delete ``.weight``; the MiniMax-H3 text encoder slices
    # ``qkv_proj.weight`` and ``gate_up_proj.weight`` directly (``minimax_h3/encoder.py``). And at the synthetic
    # checkpoints' small widths the prepacked kernel is sgl-kernel's ``weight_packed_linear``, whose fake (traced)
    # output is 2-D for a 3-D input, which breaks Wan2.2's compiled blocks. Keep the weights and torch's linear.
    _wrap(layer_utils, "dispatch_cpu_unquantized_gemm", lambda f: _torch_linear)

    # ``Qwen3VLProcessor.from_pretrained`` builds a video processor that needs torchvision, which does not load
    # beside torch+cpu; the pipeline uses only the processor's ``image_processor`` (PIL works).
    pipeline_minimax_h3.Qwen3VLProcessor = _ImageOnlyProcessor

    # The adapters' offload ends in ``torch.accelerator.empty_cache()``, which raises without an accelerator:
    # send it to the platform's counted ``empty_cache``, the one place that marks where memory would be released.
    _wrap(torch.accelerator, "empty_cache", lambda f: lambda: _platform_empty_cache())

    # The worker's output thread asks ``torch.accelerator.current_accelerator().type`` for a copy stream and
    # dies on None (``diffusion/worker/diffusion_worker.py``): that thread gets "cpu".
    _wrap(torch.accelerator, "current_accelerator", _cpu_for_the_output_thread)

    # Model-level offload never reaches its empty_cache() on CPU: parameters never leave the CPU, so
    # ``SequentialOffloadHook._to_cpu`` returns early (``diffusion/offloader/sequential_backend.py``). Track which
    # components an accelerator run would hold on the device and count an empty_cache where it would evict one.
    _wrap(SequentialOffloadHook, "_to_gpu", _mark_resident)
    _wrap(SequentialOffloadHook, "_to_cpu", _release_if_resident)

    # Ring attention calls ``aten._scaled_dot_product_efficient_attention``, which has no CPU kernel
    # (``diffusion/attention/backends/ring/ring_kernels.py``); the CPU flash kernel returns the same (out, lse).
    ring_kernels._scaled_dot_product_efficient_attention = _efficient_attention_on_cpu

    # Packing outputs into shared memory with a copy stream calls ``torch.accelerator.current_stream()``, which
    # raises on CPU (``diffusion/ipc.py``); without a stream it copies synchronously.
    _wrap(diffusion_worker, "pack_diffusion_output_shm", lambda f: lambda output, d2h_stream=None: f(output))


_resident: weakref.WeakSet = weakref.WeakSet()
_TORCHVISION = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


def _import_wan2_2_without_torchvision() -> None:
    """Import ``vllm_omni.diffusion.models.wan2_2`` with a torchvision that raises when called, then forget it.

    The package imports its image- and speech-to-video pipelines, which import torchvision at module level
    (``pipeline_wan2_2_i2v.py``, ``pipeline_wan2_2_s2v.py``); torchvision does not load beside torch+cpu and
    text-to-video never calls it. The stand-in is in ``sys.modules`` only during that import, after transformers
    and diffusers are loaded: while it is there, their availability checks would take it for the real package.
    """
    import sys

    import diffusers  # noqa: F401
    import transformers
    from transformers import AutoTokenizer, UMT5EncoderModel  # noqa: F401  (what wan2_2 takes from transformers)

    from .startup import Unavailable

    if "vllm_omni.diffusion.models.wan2_2" in sys.modules or transformers.utils.is_torchvision_available():
        return
    stand_ins = {name: Unavailable(name) for name in _TORCHVISION}
    for name, module in stand_ins.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(stand_ins[parent], child, module)
    sys.modules.update(stand_ins)
    try:
        import vllm_omni.diffusion.models.wan2_2  # noqa: F401
    finally:
        for name in _TORCHVISION:
            sys.modules.pop(name, None)


def _torch_linear(layer, remove_weight: bool) -> None:
    layer.cpu_linear = torch.nn.functional.linear


def _platform_empty_cache() -> None:
    from vllm_omni.platforms import current_omni_platform

    current_omni_platform.empty_cache()


def _mark_resident(original):
    def to_gpu(self, module):
        original(self, module)
        _resident.add(module)

    return to_gpu


def _release_if_resident(original):
    def to_cpu(self, module):
        original(self, module)
        if module in _resident:
            _resident.discard(module)
            _platform_empty_cache()

    return to_cpu


def _efficient_attention_on_cpu(query, key, value, *, dropout_p=0.0, is_causal=False, scale=None, **_bias_and_lse):
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale)


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
