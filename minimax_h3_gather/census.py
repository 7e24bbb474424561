# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""A census of every collective a MiniMax-H3 request makes, taken inside real serving workers.

``vllm_omni.general_plugins`` entry point, inert unless ``VLLM_OMNI_H3_CENSUS_DIR`` names a directory. Then
each worker watches every ``torch.distributed`` collective with a ``CollectiveLedger`` from its first
request on, attributes each to a pipeline component by its caller, closes a release window wherever the
platform or the adapters empty the cache, samples memory (on a device, used minus reserved; on CPU, the
RSS), and after every request writes ``census-rank<r>.json`` there. A
diagnostic for a few requests: on CPU ranks the ledger holds every buffer it sees, so that a freed address is
never taken for a reused one; on a device it holds none, so the backend sees the addresses it would see anyway.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import torch
from vllm.logger import init_logger

from vllm_omni.distributed import persistent_collectives
from vllm_omni.distributed.collective_workspaces import resolve_device

from .ledger import CollectiveLedger
from .memory import memory_record

logger = init_logger(f"vllm_omni.plugins.{__name__}")

CENSUS_ENV = "VLLM_OMNI_H3_CENSUS_DIR"
COMPONENTS = ("text_encoder", "dit", "video_vae", "audio_vae", "other")
_MARK = "_minimax_h3_census_hook"
# Pipeline helpers that only move another component's tensors; the component is their caller's.
_PIPELINE_HELPERS = ("_broadcast_tensor", "_encoder_group_broadcast_tensor", "_distribute_encode_inputs")


def census_dir() -> Path | None:
    raw = os.environ.get(CENSUS_ENV)
    if raw is None:
        return None
    path = Path(raw)
    if not raw.strip() or not path.is_dir():
        raise ValueError(f"{CENSUS_ENV}={raw!r} is not an existing directory; unset it to take no census")
    return path


def qualname(code: CodeType, local_names: Mapping[str, Any]) -> str:
    """``co_qualname`` where Python has it (3.11+); before, the class of ``self`` or ``cls`` and the name."""
    if hasattr(code, "co_qualname"):
        return code.co_qualname
    owner = local_names.get("self", local_names.get("cls"))
    if owner is None:
        return code.co_name
    return f"{(owner if isinstance(owner, type) else type(owner)).__qualname__}.{code.co_name}"


def classify(frame: FrameType | None) -> str:
    """The pipeline component a collective belongs to: the innermost caller that names one."""
    while frame is not None:
        path, name = frame.f_code.co_filename, qualname(frame.f_code, frame.f_locals)
        file = Path(path).name
        if file in ("klvae.py", "vae_gather.py") or name.startswith("MiniMaxH3VideoVAE"):
            return "video_vae"
        if file == "parallel.py" and "transformers_modules" in path:  # the checkpoint's var-shape gather
            return "video_vae"
        if "audio_vae" in file or name.startswith("MiniMaxH3AudioVAE"):
            return "audio_vae"
        if file == "minimax_h3_transformer.py":
            return "dit"
        if file == "encoder.py" and "minimax_h3" in path:
            return "text_encoder"
        if file == "pipeline_minimax_h3.py" and not name.endswith(_PIPELINE_HELPERS):
            lowered = name.lower()
            for component, words in (("text_encoder", ("text", "prompt")), ("audio_vae", ("audio",))):
                if any(word in lowered for word in words):
                    return component
            if any(word in lowered for word in ("video", "image", "decode")):
                return "video_vae"
        frame = frame.f_back
    return "other"


def compile_record(pipeline: Any) -> dict[str, Any]:
    """Whether the DiT's blocks ran as Dynamo-compiled code, and the graph breaks Dynamo counted in this process."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    blocks = list(getattr(getattr(pipeline, "transformer", None), "blocks", None) or [])
    codes = {type(block).forward.__code__ for block in blocks}
    return {
        "dit_compiled": bool(codes) and all(_debug_get_cache_entry_list(code) for code in codes),
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def _marking_releases(ledger: CollectiveLedger) -> Callable[[Callable], Callable]:
    """Wrap a cache-emptying function so that each outermost call closes a release window."""
    depth = [0]

    def wrap(empty_cache: Callable) -> Callable:
        @functools.wraps(empty_cache)
        def empty_cache_and_mark(*args, **kwargs):
            depth[0] += 1
            try:
                return empty_cache(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:  # the platform's empty_cache may call torch's: one release, not two
                    ledger.mark_release()

        setattr(empty_cache_and_mark, _MARK, True)
        return empty_cache_and_mark

    return wrap


def register() -> None:
    """Hook the MiniMax-H3 pipeline's ``forward`` and both ways of emptying the cache in this worker.

    The adapters call ``torch.accelerator.empty_cache()`` themselves; the offloader calls the platform's.
    """
    directory = census_dir()
    if directory is None:
        return
    from vllm_omni.diffusion.models.minimax_h3.pipeline_minimax_h3 import MiniMaxH3Pipeline
    from vllm_omni.platforms import current_omni_platform

    if getattr(MiniMaxH3Pipeline.forward, _MARK, False):
        return
    # Off a CPU run the ledger only counts: holding real buffers would change the addresses the backend sees.
    on_cpu = current_omni_platform.device_type == "cpu" or not torch.accelerator.is_available()
    ledger = CollectiveLedger(limit=None, classify=classify, hold_buffers=on_cpu)
    device = resolve_device("cpu" if on_cpu else current_omni_platform.device_type)  # whose memory is sampled
    mark = _marking_releases(ledger)
    platform = type(current_omni_platform)
    if callable(getattr(platform, "empty_cache", None)):
        platform_empty_cache = mark(platform.empty_cache)
        platform.empty_cache = classmethod(lambda cls: platform_empty_cache())
    torch.accelerator.empty_cache = mark(torch.accelerator.empty_cache)
    forward = MiniMaxH3Pipeline.forward

    timing: list[dict[str, float]] = []
    layer_stats: list[dict[str, int] | None] = []
    memory: list[dict[str, Any]] = []
    compiled: list[dict[str, Any]] = []

    @functools.wraps(forward)
    def counted_forward(self, *args, **kwargs):
        if not ledger.active:
            ledger.__enter__()  # at the latest from the first request on; the worker's lifetime ends it
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return forward(self, *args, **kwargs)
        finally:
            # This worker's wall and process CPU seconds for the request, the census's own bookkeeping included.
            timing.append({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu})
            ledger.end_request()
            collectives = persistent_collectives.platform_collectives()
            layer_stats.append(collectives.stats() if collectives.staged else None)  # since start-up
            memory.append(memory_record(device))
            compiled.append(compile_record(self))
            books = {"timing": timing, "persistent_collectives": layer_stats, "memory": memory, "compile": compiled}
            _write(directory, ledger, books)

    setattr(counted_forward, _MARK, True)
    MiniMaxH3Pipeline.forward = counted_forward
    init = MiniMaxH3Pipeline.__init__

    @functools.wraps(init)
    def init_and_count(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if not ledger.active:
            # From the pipeline's construction on: what a worker does before its first forward (a scheduler's
            # object broadcast, say) is booked with request 1, so that request 2 sees it as a reuse, not a first.
            ledger.__enter__()

    MiniMaxH3Pipeline.__init__ = init_and_count
    logger.info("[H3_CENSUS] counting every collective per request into %s", directory)


def _write(directory: Path, ledger: CollectiveLedger, per_request: dict[str, list]) -> None:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    books = {"rank": rank, "requests": [r.as_dict() for r in ledger.requests], **per_request}
    (directory / f"census-rank{rank}.json").write_text(json.dumps(books, indent=1))
