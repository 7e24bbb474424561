# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""``VLLM_OMNI_PERSISTENT_COLLECTIVES`` and what install and uninstall do to ``torch.distributed``."""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from vllm_omni.distributed import persistent_collectives as pc

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion]


@pytest.fixture(autouse=True)
def plain_collectives():
    pc.uninstall_persistent_collectives()
    before = {(ns.__name__, name): getattr(ns, name) for ns in (dist, c10d) for name in pc.KINDS}
    yield before
    pc.uninstall_persistent_collectives()
    assert {(ns.__name__, name): getattr(ns, name) for ns in (dist, c10d) for name in pc.KINDS} == before


@pytest.mark.parametrize(("value", "installs"), [("auto", False), (" AUTO ", False), ("0", False), ("1", True)])
def test_the_switch_installs_on_1_and_in_auto_mode_only_on_xpu(monkeypatch, value, installs):
    monkeypatch.setenv(pc.SWITCH_ENV, value)
    assert pc.install_persistent_collectives() is installs
    assert (pc.installed() is not None) is installs
    # Both names: callers reach torch.distributed's, the object collectives reach distributed_c10d's.
    assert (dist.all_reduce is pc.STAGED["all_reduce"]) is installs
    assert (c10d.broadcast is pc.STAGED["broadcast"]) is installs


def test_auto_mode_installs_when_an_xpu_is_present(monkeypatch):
    # Stand-in: this machine has no XPU, so torch.xpu.is_available is made to say it has one.
    monkeypatch.delenv(pc.SWITCH_ENV, raising=False)
    monkeypatch.setattr(pc.torch.xpu, "is_available", lambda: True)
    assert pc.install_persistent_collectives()
    assert pc.installed().device_type == "xpu"


@pytest.mark.parametrize("value", ["yes", "", "2", "true"])
def test_any_other_value_is_an_error_naming_it(monkeypatch, value):
    monkeypatch.setenv(pc.SWITCH_ENV, value)
    with pytest.raises(ValueError, match=f"{pc.SWITCH_ENV}={value!r} is not valid; expected one of"):
        pc.install_persistent_collectives()
    assert pc.installed() is None


def test_install_is_idempotent_and_uninstall_restores_the_plain_functions(plain_collectives):
    assert pc.install_persistent_collectives(enabled=True, device_type="cpu")
    wrapped = dist.all_reduce
    assert pc.install_persistent_collectives(enabled=True, device_type="cpu") and dist.all_reduce is wrapped
    assert pc.installed().plain["all_reduce"] is plain_collectives["torch.distributed", "all_reduce"]
    pc.uninstall_persistent_collectives()
    assert dist.all_reduce is plain_collectives["torch.distributed", "all_reduce"] and pc.installed() is None


def test_uninstall_restores_the_originals_even_when_a_census_wraps_the_backend_side(plain_collectives):
    assert pc.install_persistent_collectives(enabled=True, device_type="cpu")
    pc.installed().plain["all_reduce"] = lambda *args, **kwargs: None  # what a ledger does below the layer
    pc.uninstall_persistent_collectives()
    assert dist.all_reduce is plain_collectives["torch.distributed", "all_reduce"]
