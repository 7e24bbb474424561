# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The plugin's rule on a module: which globals it rebinds to the managed collectives, and which it leaves."""

from __future__ import annotations

import sys
import textwrap
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from vllm_omni.distributed import managed_distributed, persistent_fsdp
from xpu_collective_memory import request_path

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion]

SOURCE = """
import torch
import torch.distributed as dist
from torch.distributed import P2POp, all_reduce, get_rank, isend
from torch.distributed.fsdp import fully_shard

def by_full_name(x):
    torch.distributed.all_reduce(x)
"""


def _module(name: str, source: str, tmp_path, monkeypatch) -> ModuleType:
    """A real module, imported from a file, so that its source can be read as the rule reads it."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    monkeypatch.delitem(sys.modules, name)
    return module


def test_the_rule_rebinds_every_global_naming_a_staged_collective_and_leaves_the_rest(tmp_path, monkeypatch):
    module = _module("rule_all_names", SOURCE, tmp_path, monkeypatch)
    rebound = request_path.rebind_module(module)
    assert sorted(rebound) == sorted(
        f"rule_all_names.{name}" for name in ("torch", "dist", "P2POp", "all_reduce", "isend", "fully_shard")
    )
    assert module.dist is managed_distributed and module.all_reduce is managed_distributed.all_reduce
    assert module.isend is managed_distributed.isend and module.fully_shard is persistent_fsdp.fully_shard
    assert module.torch.distributed is managed_distributed and module.torch.float32 is torch.float32
    assert module.get_rank is dist.get_rank  # not a collective


def test_torch_is_rebound_only_where_a_collective_is_called_by_its_full_name(tmp_path, monkeypatch):
    source = "import torch\n\ndef f(x):\n    return torch.cat([x])\n"
    module = _module("rule_no_full_name", source, tmp_path, monkeypatch)
    assert request_path.rebind_module(module) == [] and module.torch is torch


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_rebound_p2pop_takes_the_rebound_isend_which_torchs_refuses(tmp_path, monkeypatch, one_rank):
    module = _module("rule_p2p", SOURCE, tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="Invalid ``op``"):
        module.P2POp(managed_distributed.isend, torch.zeros(1), 1)  # torch's own, before the rule
    request_path.rebind_module(module)
    op = module.P2POp(module.dist.isend, torch.zeros(1), 1)
    assert op.op is dist.isend and isinstance(op, dist.P2POp)


def test_the_rule_covers_the_diffusion_tree_but_not_a_module_with_blocks_of_its_own():
    assert request_path.routed("vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image")
    assert not request_path.routed("vllm_omni.diffusion.models.minimax_h3.vae_gather")
    assert not request_path.routed("vllm_omni.entrypoints.openai.api_server")
    assert request_path.hook_for("vllm_omni.diffusion.distributed.hsdp") is request_path.rebind_module
    assert request_path.hook_for("vllm_omni.engine.arg_utils") is None
    assert fully_shard is not persistent_fsdp.fully_shard
