# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
import logging

import pytest
import torch

from vllm_omni.diffusion.models.minimax_h3 import vae_gather
from vllm_omni.distributed import collective_workspaces

from .fake_collective import install_fake_collective
from .stand_ins import RecordingHandler


@pytest.fixture
def fake_collective(monkeypatch):
    """``dist.all_gather_single`` on thread ranks goes to their ThreadWorld recorder."""
    install_fake_collective(monkeypatch)


@pytest.fixture
def gather_log():
    """Every record vae_gather logs during the test, DEBUG included."""
    logger = logging.getLogger(vae_gather.__name__)
    handler = RecordingHandler()
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(previous)


@pytest.fixture
def device_stand_in(monkeypatch):
    """Stand-in for XPU and CUDA cards, which this machine lacks: ``xpu`` resolves to ``xpu:0`` (``cuda`` alike)
    and memory asked of them comes from the CPU. Returns the devices asked for, in order."""
    asked: list[torch.device] = []
    real = collective_workspaces.allocate_bytes

    def allocate(nbytes, device, group):
        asked.append(device)
        return real(nbytes, torch.device("cpu") if device.type in ("xpu", "cuda") else device, group)

    monkeypatch.setattr(torch.xpu, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(collective_workspaces, "allocate_bytes", allocate)
    return asked
