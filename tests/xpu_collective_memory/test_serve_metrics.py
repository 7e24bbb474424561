# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The memory figure on ``/metrics``: what a worker samples after a request, how it rides in ``stage_durations`` and
leaves it before any response sees it, and the series the API server sets (served end to end in
``tests/e2e/test_minimax_h3_serve_cpu.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prometheus_client import REGISTRY

from xpu_collective_memory import serve_metrics

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


def test_a_cpu_worker_samples_its_rss_labelled_so_and_what_the_project_holds():
    serve_metrics.holding(lambda: (1.0, 3 * 2**20))
    figures = serve_metrics.sample(torch.device("cpu"))
    assert figures["xpu_collective_memory.rss"] == 1.0 and figures["xpu_collective_memory.outside_pytorch_mb"] > 0
    assert figures["xpu_collective_memory.held_mb"] == 3.0 and figures["xpu_collective_memory.mechanism"] == 1.0
    assert figures["xpu_collective_memory.rank"] == 0.0


def test_every_output_of_a_request_carries_the_sample_beside_its_own_durations_and_the_runner_is_hooked_once():
    class Runner:
        device = torch.device("cpu")

        def _runner_output_from_outputs(self, reqs, outputs):
            return [output.stage_durations for output in outputs]

    module = SimpleNamespace(DiffusionModelRunner=Runner)
    assert serve_metrics.hook_runner(module) and serve_metrics.hook_runner(module)
    assert not hasattr(Runner._runner_output_from_outputs.__wrapped__, "__wrapped__")
    got = Runner()._runner_output_from_outputs(
        [], [SimpleNamespace(stage_durations={"x.diffuse": 2.0}), SimpleNamespace(stage_durations=None)]
    )
    assert all("xpu_collective_memory.outside_pytorch_mb" in durations for durations in got)
    assert got[0]["x.diffuse"] == 2.0


def test_the_server_takes_the_sample_out_before_the_response_and_sets_the_stages_series():
    serve_metrics.holding(lambda: (1.0, 2**20))
    durations = {"x.diffuse": 2.0, **serve_metrics.sample(torch.device("cpu"))}
    figures = serve_metrics.take_sample(durations)
    assert durations == {"x.diffuse": 2.0} and serve_metrics.take_sample(None) == {}
    serve_metrics.publish("m", 7, figures)
    serve_metrics.publish("m", 7, figures)
    labels = {"model_name": "m", "stage": "7", "rank": "0"}
    assert REGISTRY.get_sample_value("vllm_omni:memory_outside_pytorch_samples_total", labels) == 2.0
    outside = {**labels, "measure": "process RSS (CPU test platform)"}
    assert REGISTRY.get_sample_value("vllm_omni:memory_outside_pytorch_mb", outside) == figures["outside_pytorch_mb"]
    held = {**labels, "mechanism": "staging"}
    assert REGISTRY.get_sample_value("vllm_omni:collective_memory_held_mb", held) == figures["held_mb"]
