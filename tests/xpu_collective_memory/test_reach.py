# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The reach check: every collective call site of the installed vLLM-Omni's diffusion tree is routed or reviewed,
and a site of any spelling that is neither fails it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from xpu_collective_memory import reach
from xpu_collective_memory.reach_table import REASONS

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion]

ROOT = Path(__file__).resolve().parents[2]
RELEASE_TREES = sorted(ROOT.glob(".venv*/lib/python3*/site-packages/vllm_omni/diffusion"))

# One module per spelling of a collective call; (op, via) each must be found as.
SPELLINGS = {
    "aliased.py": ("import torch.distributed as d\ndef f(x):\n    d.all_reduce(x)\n", ("all_reduce", "dist")),
    "full_name.py": ("import torch\ndef f(x):\n    torch.distributed.broadcast(x, 0)\n", ("broadcast", "dist")),
    "from_import.py": (
        "from torch.distributed import all_gather as ag\ndef f(out, x):\n    ag(out, x)\n",
        ("all_gather", "dist"),
    ),
    "submodule.py": ("from torch import distributed\ndef f(x):\n    distributed.barrier()\n", ("barrier", "dist")),
    "functional.py": (
        "import torch.distributed._functional_collectives as funcol\ndef f(x):\n    funcol.all_reduce(x, 'sum', g)\n",
        ("all_reduce", "functional"),
    ),
    "coordinator.py": (
        "def f(x, g):\n    get_sp_group().all_gather(x, dim=1, group=g)\n    x.gather(0, x)\n",
        ("all_gather", "coordinator"),
    ),
    "fsdp.py": (
        "from torch.distributed.fsdp import fully_shard\ndef f(m):\n    fully_shard(m)\n",
        ("fully_shard", "fsdp"),
    ),
    "managed.py": (
        "from vllm_omni.distributed import managed_distributed as dist\ndef f(x):\n    dist.all_to_all_single(x, x)\n",
        ("all_to_all_single", "managed"),
    ),
    "guarded.py": (
        "try:\n    import torch.distributed as dist\nexcept ImportError:\n    dist = None\n"
        "def f(x):\n    dist.send(x, 1)\n",
        ("send", "dist"),
    ),
    # Neither can the rule rebind: a function's own import, another module of torch.distributed.
    "local.py": ("def f(x):\n    import torch.distributed as dist\n    dist.broadcast(x, 0)\n", ("broadcast", "local")),
    "c10d.py": (
        "import torch\ndef f(x):\n    torch.distributed.distributed_c10d.all_reduce(x)\n",
        ("all_reduce", "other"),
    ),
}
NEVER_ROUTED = ("functional.py", "local.py", "c10d.py")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "distributed").mkdir()
    (tmp_path / "distributed" / "group_coordinator.py").write_text("class GroupCoordinator:\n    pass\n")
    for name, (source, _) in SPELLINGS.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    return tmp_path


def test_every_spelling_of_a_collective_call_is_found_once_as_what_it_is(tree):
    found = {site.path: (site.op, site.via) for site in reach.scan(tree)}
    assert found == {name: expected for name, (_, expected) in SPELLINGS.items()}


def test_under_the_rule_module_level_names_are_routed_and_what_it_cannot_rebind_fails_the_check(tree, capsys):
    assert reach.main(["--tree", str(tree)]) == 1
    verdicts = {v.site.path: v.status for v in reach.verdicts(list(reach.scan(tree)), True, True)}
    assert verdicts == {**dict.fromkeys(SPELLINGS, "routed"), **dict.fromkeys(NEVER_ROUTED, "unknown")}
    err = capsys.readouterr().err
    assert all(f"FAIL {name}:3 " in err for name in NEVER_ROUTED), err


def test_without_the_plugin_only_the_trees_own_managed_imports_are_routed(tree):
    verdicts = {v.site.path: v.status for v in reach.verdicts(list(reach.scan(tree)), False, False)}
    assert verdicts == {**dict.fromkeys(SPELLINGS, "unknown"), "managed.py": "routed"}


def test_an_async_call_of_a_kind_the_layer_stages_is_routed_and_a_kind_it_does_not_is_not(tmp_path):
    (tmp_path / "m.py").write_text(
        "import torch.distributed as dist\ndef f(x):\n    dist.broadcast(x, 0, async_op=True)\n    dist.scatter(x)\n"
    )
    verdicts = {v.site.op: v.status for v in reach.verdicts(list(reach.scan(tmp_path)), True, True)}
    assert verdicts == {"broadcast": "routed", "scatter": "unknown"}


@pytest.mark.integration
def test_the_installed_release_has_no_request_path_site_left_unrouted_or_unreviewed(capsys):
    assert reach.main([]) == 0, capsys.readouterr().err


@pytest.mark.skipif(len(RELEASE_TREES) < 2, reason="needs both supported releases' environments (scripts/test.sh)")
def test_every_reviewed_entry_names_a_site_of_a_supported_release():
    keys = {site.key for tree in RELEASE_TREES for site in reach.scan(tree)}
    assert set(REASONS) - keys == set()
