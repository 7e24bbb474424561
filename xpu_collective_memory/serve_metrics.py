# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The figure that grows, on ``vllm-omni serve``'s own ``/metrics``: per diffusion stage, after each request, the
memory outside PyTorch and what this project holds, by the route upstream's ``vllm_omni:peak_memory_mb`` takes.

A diffusion worker samples after each request's forward (``DiffusionModelRunner._runner_output_from_outputs``): on a
card, the driver's used memory minus ``memory_reserved()`` (one device sync), on CPU ranks the process RSS; and
staging's block bytes or the request pool's segments. The sample rides in the output's ``stage_durations``, the one
field that reaches the API server unchanged; there ``OmniBase._process_single_result`` takes it out (responses never
see it) and sets the gauges. As for ``peak_memory_mb``, the figure is the replying rank's (rank 0 of the stage): the
census has every rank's. Hooked only where staging or the pool is on, like the rest of the plugin.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist
from vllm.logger import init_logger

logger = init_logger(f"vllm_omni.plugins.{__name__}")

RUNNER_MODULE = "vllm_omni.diffusion.worker.diffusion_model_runner"
SERVER_MODULE = "vllm_omni.entrypoints.omni_base"
PREFIX = "xpu_collective_memory."  # the sample's keys in stage_durations
MECHANISMS = {1.0: "staging", 2.0: "request pool"}
_MARK = "_serve_metrics_hook"
_held: list[Any] = []  # in a worker: what reports the bytes this project holds (staging's, or the pool's)


def holding(report) -> None:
    """In a diffusion worker: ``report() -> (mechanism, bytes held)``, sampled after each request."""
    _held[:] = [report]


def sample(device: Any) -> dict[str, float]:
    """This worker's figures after a request, as ``stage_durations`` keys."""
    from vllm_omni.distributed import collective_workspaces

    from .memory import process_rss_bytes, sample_memory

    on_card = sample_memory(collective_workspaces.resolve_device(device)) if device.type != "cpu" else None
    outside = on_card.non_pytorch_bytes if on_card is not None else process_rss_bytes()
    mechanism, held = _held[0]() if _held else (0.0, 0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return {
        f"{PREFIX}outside_pytorch_mb": outside / 2**20,
        f"{PREFIX}rss": 0.0 if on_card is not None else 1.0,
        f"{PREFIX}held_mb": held / 2**20,
        f"{PREFIX}mechanism": mechanism,
        f"{PREFIX}rank": float(rank),
    }


def _wrap_once(module: Any, cls_name: str, method: str, wrapping) -> bool:
    """``cls_name.method`` of ``module`` replaced by ``wrapping(original)``, once; False where it is missing."""
    cls = getattr(module, cls_name, None)
    original = getattr(cls, method, None)
    if not callable(original):
        logger.warning("[XPU_COLLECTIVE_MEMORY] %s has no %s.%s: no memory figure on /metrics", module.__name__,
                       cls_name, method)  # fmt: skip
        return False
    if not getattr(original, _MARK, False):
        wrapper = functools.wraps(original)(wrapping(original))
        setattr(wrapper, _MARK, True)
        setattr(cls, method, wrapper)
    return True


def hook_runner(module: Any) -> bool:
    """Every request's outputs carry the worker's sample."""

    def wrapping(original):
        def _runner_output_from_outputs(self, reqs, outputs):
            figures = sample(self.device)
            for output in outputs:
                output.stage_durations = {**(output.stage_durations or {}), **figures}
            return original(self, reqs, outputs)

        return _runner_output_from_outputs

    return _wrap_once(module, "DiffusionModelRunner", "_runner_output_from_outputs", wrapping)


@functools.cache
def _gauges() -> dict[str, Any]:
    """Defined once per process, in the registry ``/metrics`` serves, in vLLM-Omni's names and labels."""
    from prometheus_client import Counter, Gauge

    labels = ["model_name", "stage", "rank"]
    return {
        "outside": Gauge(
            "vllm_omni:memory_outside_pytorch_mb",
            "Memory outside PyTorch after the last request, MiB: on a card the driver's used minus memory_reserved(); "
            "on CPU ranks the process RSS (measure label)",
            labelnames=[*labels, "measure"],
        ),
        "held": Gauge(
            "vllm_omni:collective_memory_held_mb",
            "MiB this project holds after the last request: staging's blocks or the request pool's segments",
            labelnames=[*labels, "mechanism"],
        ),
        "samples": Counter(
            "vllm_omni:memory_outside_pytorch_samples",
            "Requests whose memory outside PyTorch was sampled",
            labelnames=labels,
        ),
    }


def take_sample(stage_durations: dict | None) -> dict[str, float]:
    """The worker's sample, taken out of ``stage_durations`` (empty where there is none)."""
    if not stage_durations:
        return {}
    return {key[len(PREFIX) :]: stage_durations.pop(key) for key in list(stage_durations) if key.startswith(PREFIX)}


def publish(model_name: str, stage: int, figures: dict[str, float]) -> None:
    gauges = _gauges()
    labels = {"model_name": model_name, "stage": str(stage), "rank": str(int(figures["rank"]))}
    measure = "process RSS (CPU test platform)" if figures["rss"] else "device used minus reserved"
    gauges["outside"].labels(**labels, measure=measure).set(figures["outside_pytorch_mb"])
    mechanism = MECHANISMS.get(figures["mechanism"], "off")
    gauges["held"].labels(**labels, mechanism=mechanism).set(figures["held_mb"])
    gauges["samples"].labels(**labels).inc()


def hook_server(module: Any) -> bool:
    """The API server sets the gauges from each diffusion stage's output, as it sets ``peak_memory_mb``."""

    def wrapping(original):
        def _process_single_result(self, result, stage_id, *args, **kwargs):
            figures = take_sample(getattr(getattr(result, "engine_outputs", None), "stage_durations", None))
            metrics = getattr(self, "prom_metrics", None)
            if figures and getattr(metrics, "_log_stats", False):
                publish(metrics._model_name, stage_id, figures)
            return original(self, result, stage_id, *args, **kwargs)

        return _process_single_result

    return _wrap_once(module, "OmniBase", "_process_single_result", wrapping)
