# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The test-only CPU platform (tests/cpu_platform) activates only on request and without an accelerator.

Anywhere else its entry points return nothing and change nothing: that is what keeps it harmless in an
environment that also serves for real.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import vllm_omni_cpu_test_platform as cpu_platform
from vllm_omni_cpu_test_platform import workarounds

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


@pytest.mark.parametrize(
    "env,accelerator,expected",
    [(None, False, None), ("0", False, None), ("1", False, cpu_platform.PLATFORM), ("1", True, None)],
    ids=["unset", "off", "requested", "requested-but-an-accelerator-exists"],
)
def test_the_platform_entry_point_answers_only_when_requested_and_no_accelerator_exists(
    monkeypatch, env, accelerator, expected
):
    if env is None:
        monkeypatch.delenv(cpu_platform.ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_platform.ENV, env)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: accelerator)
    assert cpu_platform.activate() == expected


@pytest.mark.parametrize("value", ["yes", "true", "2", ""])
def test_a_bad_switch_value_is_an_error_naming_it(monkeypatch, value):
    monkeypatch.setenv(cpu_platform.ENV, value)
    with pytest.raises(ValueError, match=f"{cpu_platform.ENV}={value!r} is not valid"):
        cpu_platform.activate()


def _patch_points():
    import vllm.model_executor.layers.utils as layer_utils

    from vllm_omni.diffusion.attention.backends.ring import ring_kernels
    from vllm_omni.diffusion.models.minimax_h3 import pipeline_minimax_h3
    from vllm_omni.diffusion.offloader.sequential_backend import SequentialOffloadHook
    from vllm_omni.diffusion.worker import diffusion_worker

    return {
        "prepack": layer_utils.dispatch_cpu_unquantized_gemm,
        "processor": pipeline_minimax_h3.Qwen3VLProcessor,
        "empty_cache": torch.accelerator.empty_cache,
        "current_accelerator": torch.accelerator.current_accelerator,
        "to_gpu": SequentialOffloadHook._to_gpu,
        "to_cpu": SequentialOffloadHook._to_cpu,
        "ring": ring_kernels._scaled_dot_product_efficient_attention,
        "pack": diffusion_worker.pack_diffusion_output_shm,
    }


@pytest.mark.parametrize("env,accelerator", [(None, False), ("1", True)], ids=["not-requested", "accelerator"])
def test_the_workarounds_change_nothing_where_the_platform_is_not_active(monkeypatch, env, accelerator):
    if env is None:
        monkeypatch.delenv(cpu_platform.ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_platform.ENV, env)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: accelerator)
    before = _patch_points()
    workarounds.apply()
    assert _patch_points() == before


def test_the_workarounds_apply_once_where_the_platform_is_active(monkeypatch):
    monkeypatch.setenv(cpu_platform.ENV, "1")
    before = _patch_points()
    try:
        workarounds.apply()
        once = _patch_points()
        workarounds.apply()
        assert _patch_points() == once  # idempotent: a second load wraps nothing twice
        assert all(once[name] is not before[name] for name in before)
    finally:  # leave this process as it was for the other tests
        import vllm.model_executor.layers.utils as layer_utils

        from vllm_omni.diffusion.attention.backends.ring import ring_kernels
        from vllm_omni.diffusion.models.minimax_h3 import pipeline_minimax_h3
        from vllm_omni.diffusion.offloader.sequential_backend import SequentialOffloadHook
        from vllm_omni.diffusion.worker import diffusion_worker

        layer_utils.dispatch_cpu_unquantized_gemm = before["prepack"]
        pipeline_minimax_h3.Qwen3VLProcessor = before["processor"]
        torch.accelerator.empty_cache = before["empty_cache"]
        torch.accelerator.current_accelerator = before["current_accelerator"]
        SequentialOffloadHook._to_gpu = before["to_gpu"]
        SequentialOffloadHook._to_cpu = before["to_cpu"]
        ring_kernels._scaled_dot_product_efficient_attention = before["ring"]
        diffusion_worker.pack_diffusion_output_shm = before["pack"]


CHECK_TORCHAUDIO = """
try:
    import torchaudio
except ModuleNotFoundError:
    print("absent")
else:
    try:
        torchaudio.functional.resample(None, 1, 2)
    except RuntimeError as exc:
        print("stand-in:", exc)
"""


@pytest.mark.parametrize("env,expected", [("0", "absent"), ("1", "stand-in: torchaudio.functional.resample")])
def test_the_torchaudio_stand_in_exists_only_when_requested_and_raises_when_called(env, expected):
    done = subprocess.run(
        [sys.executable, "-c", CHECK_TORCHAUDIO],
        env=os.environ | {cpu_platform.ENV: env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.startswith(expected), done.stdout + done.stderr
