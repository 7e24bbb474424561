# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
import logging

import pytest

from vllm_omni.diffusion.models.minimax_h3 import vae_gather

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
