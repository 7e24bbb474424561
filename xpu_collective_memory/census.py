# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""A census of every collective a served request makes, by pipeline component, taken inside real serving workers.

``vllm_omni.general_plugins`` entry point, inert unless ``VLLM_OMNI_COLLECTIVE_CENSUS_DIR`` names a directory. Then
each diffusion worker watches every ``torch.distributed`` collective with a ``CollectiveLedger`` once its model
runner has loaded the pipeline (any pipeline; MiniMax-H3, Wan2.2 and Qwen-Image are classified by component),
attributes each to a component by its caller, closes a release window wherever the platform or the adapters
empty the cache, samples memory (on a device, used minus reserved; on CPU, the RSS), and after every request
writes ``census-rank<r>.json`` there. The engine's warm-up run is booked with request 1. A diagnostic for a few
requests: on CPU ranks the ledger holds every buffer it sees, so that a freed address is never taken for a
reused one; on a device it holds none, so the backend sees the addresses it would see anyway.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import torch
from vllm.logger import init_logger

from vllm_omni.distributed import persistent_collectives
from vllm_omni.distributed.collective_workspaces import resolve_device

from .ledger import CollectiveLedger, worker_pool
from .memory import memory_record
from .renamed import census_dir_variable, old_entry_point
from .request_path import staged_stats

logger = init_logger(f"vllm_omni.plugins.{__name__}")

CENSUS_ENV = "VLLM_OMNI_COLLECTIVE_CENSUS_DIR"
COMPONENTS = ("text_encoder", "dit", "video_vae", "audio_vae", "other")
_MARK = "_collective_census_hook"
# Pipeline helpers that only move another component's tensors; the component is their caller's.
_PIPELINE_HELPERS = ("_broadcast_tensor", "_encoder_group_broadcast_tensor", "_distribute_encode_inputs")


def census_dir() -> Path | None:
    variable = census_dir_variable(CENSUS_ENV)
    if variable is None:
        return None
    name, raw = variable
    path = Path(raw)
    if not raw.strip() or not path.is_dir():
        raise ValueError(f"{name}={raw!r} is not an existing directory; unset it to take no census")
    return path


def qualname(code: CodeType, local_names: Mapping[str, Any]) -> str:
    """``co_qualname`` where Python has it (3.11+); before, the class of ``self`` or ``cls`` and the name."""
    if hasattr(code, "co_qualname"):
        return code.co_qualname
    owner = local_names.get("self", local_names.get("cls"))
    if owner is None:
        return code.co_name
    return f"{(owner if isinstance(owner, type) else type(owner)).__qualname__}.{code.co_name}"


# Files whose every collective is one component's, wherever they are called from (the innermost one named wins).
_FILES = {
    "klvae.py": "video_vae",  # MiniMax-H3's checkpoint VAE
    "vae_gather.py": "video_vae",
    "autoencoder_kl_wan.py": "video_vae",
    "distributed_vae_executor.py": "video_vae",  # vLLM-Omni's VAE tile parallelism (Wan2.2)
    "autoencoder_kl_qwenimage.py": "video_vae",
    "wan_spatial_shard.py": "video_vae",  # the Wan VAE's spatially sharded decode
    "minimax_h3_transformer.py": "dit",
    "wan2_2_transformer.py": "dit",
    "qwen_image_transformer.py": "dit",
    "cfg_parallel.py": "dit",  # the CFG branches' gather, once per denoising step
    "pipeline_parallel.py": "dit",  # the stages' latents and noise predictions
    "hsdp.py": "dit",
}
_PIPELINES = ("pipeline_minimax_h3.py", "pipeline_wan2_2.py", "pipeline_qwen_image.py")
_PIPELINE_WORDS = (
    ("text_encoder", ("text", "prompt")),
    ("audio_vae", ("audio",)),
    ("video_vae", ("video", "image", "decode")),
    ("dit", ("diffuse", "predict_noise")),
)


def classify(frame: FrameType | None) -> str:
    """The pipeline component a collective belongs to: the innermost caller that names one."""
    while frame is not None:
        path, name = frame.f_code.co_filename, qualname(frame.f_code, frame.f_locals)
        file = Path(path).name
        if file in _FILES:
            return _FILES[file]
        if name.startswith("MiniMaxH3VideoVAE"):
            return "video_vae"
        if file == "parallel.py" and "transformers_modules" in path:  # the checkpoint's var-shape gather
            return "video_vae"
        if "audio_vae" in file or name.startswith("MiniMaxH3AudioVAE"):
            return "audio_vae"
        if file == "encoder.py" and "minimax_h3" in path:
            return "text_encoder"
        if file in _PIPELINES and not name.endswith(_PIPELINE_HELPERS):
            lowered = name.lower()
            for component, words in _PIPELINE_WORDS:
                if any(word in lowered for word in words):
                    return component
        frame = frame.f_back
    return "other"


def compile_record(pipeline: Any) -> dict[str, Any]:
    """Whether every DiT's blocks ran as Dynamo-compiled code, and the graph breaks Dynamo counted in this process."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    dits = [dit for name in ("transformer", "transformer_2") if (dit := getattr(pipeline, name, None)) is not None]
    # The blocks regional compile compiles: by class name, also under FSDP2's FSDP<name> subclass (HSDP).
    names = {name for dit in dits for name in getattr(dit, "_repeated_blocks", None) or ()}
    blocks = [m for dit in dits for m in dit.modules() if any(c.__name__ in names for c in type(m).__mro__)]
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


def _booking_copies(write: Callable, ledger: CollectiveLedger) -> Callable:
    """The persistent collectives' copy, booked per component: the copy traffic the fix adds to a request."""

    @functools.wraps(write)
    def write_and_book(destination: torch.Tensor, source: torch.Tensor) -> None:
        write(destination, source)
        if ledger.active:
            ledger.add_staged(source.nbytes)

    return write_and_book


def register() -> None:
    """Hook the diffusion model runner's ``load_model`` and both ways of emptying the cache in this process.

    The adapters call ``torch.accelerator.empty_cache()`` themselves; the offloader calls the platform's.
    """
    directory = census_dir()
    if directory is None:
        return
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
    from vllm_omni.platforms import current_omni_platform

    if getattr(DiffusionModelRunner.load_model, _MARK, False):
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
    persistent_collectives._write = _booking_copies(persistent_collectives._write, ledger)
    books: dict[str, list] = {"timing": [], "persistent_collectives": [], "memory": [], "compile": [], "pool": []}
    load_model = DiffusionModelRunner.load_model

    @functools.wraps(load_model)
    def load_and_count(self, *args, **kwargs):
        load_model(self, *args, **kwargs)
        pipeline = getattr(self, "pipeline", None)
        if pipeline is not None and not getattr(type(pipeline).forward, _MARK, False):
            type(pipeline).forward = _counting(type(pipeline).forward, ledger, device, directory, books)
        if not ledger.active:
            # From the pipeline's load on: what a worker does before its first request (the engine's warm-up, a
            # scheduler's object broadcast) is booked with request 1, so that request 2 sees it as a reuse.
            ledger.__enter__()

    setattr(load_and_count, _MARK, True)
    DiffusionModelRunner.load_model = load_and_count
    logger.info("[COLLECTIVE_CENSUS] counting every collective per request into %s", directory)


def _counting(forward: Callable, ledger: CollectiveLedger, device, directory: Path, books: dict[str, list]):
    from vllm_omni.diffusion.request import DUMMY_DIFFUSION_REQUEST_ID

    @functools.wraps(forward)
    def counted_forward(self, batch, *args, **kwargs):
        if set(getattr(batch, "request_ids", ())) == {DUMMY_DIFFUSION_REQUEST_ID}:  # the warm-up: not a request
            return forward(self, batch, *args, **kwargs)
        wall, cpu = time.perf_counter(), time.process_time()
        pool = worker_pool()  # the request pool: the whole forward, every component, runs in it
        books["pool"].append(None if pool is None else {"in_pool": pool.active, "requests_entered": pool.requests})
        try:
            return forward(self, batch, *args, **kwargs)
        finally:
            # This worker's wall and process CPU seconds for the request, the census's own bookkeeping included.
            books["timing"].append({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu})
            ledger.end_request()
            books["persistent_collectives"].append(staged_stats())
            books["memory"].append(memory_record(device, pool=worker_pool()))
            books["compile"].append(compile_record(self))
            _write(directory, ledger, books)

    setattr(counted_forward, _MARK, True)
    return counted_forward


def _write(directory: Path, ledger: CollectiveLedger, per_request: dict[str, list]) -> None:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    books = {"rank": rank, "requests": [r.as_dict() for r in ledger.requests], **per_request}
    (directory / f"census-rank{rank}.json").write_text(json.dumps(books, indent=1))


register_minimax_h3_census = old_entry_point("minimax_h3_census", register)
