# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The upstream patches against a pristine vLLM-Omni 0.30.0 package tree, fetched from the package index.

They must apply, carry this checkout's files as they are now, and pass the patches' own tests and the
``vllm-omni serve`` test in that tree with this project's plugin switched off: the adapter, the coordinator, the
platform and the request path's modules make the fixes there themselves.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest

from tests.utils import REPO_ROOT
from tooling import upstream_patches
from xpu_collective_memory import reach

pytestmark = [
    pytest.mark.advanced_model,
    pytest.mark.cpu,
    pytest.mark.diffusion,
    pytest.mark.integration,
    pytest.mark.skipif(
        version("vllm-omni") != upstream_patches.RELEASE,
        reason=f"the patches are made against vLLM-Omni {upstream_patches.RELEASE}",
    ),
]

ADAPTER = "vllm_omni/diffusion/models/minimax_h3/vae.py"
WORKER = "vllm_omni/diffusion/worker/diffusion_worker.py"


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    tree = upstream_patches.pristine_tree(tmp_path_factory.mktemp("vllm-omni-0.30.0"))
    upstream_patches.apply_patches(tree, upstream_patches.patch_files())
    return tree


def test_the_adapter_installs_the_fix_itself_and_keeps_none_of_its_own_override(patched):
    adapter = (patched / ADAPTER).read_text()
    assert "from .vae_gather import install_tile_gather_reuse" in adapter
    assert adapter.count("install_tile_gather_reuse(self)") == 1
    for removed in ("_persistent_tile_gather", "_tile_gather_workspace", "_tile_gather_reuse_enabled"):
        assert removed not in adapter


COORDINATOR = "vllm_omni/diffusion/distributed/group_coordinator.py"
HSDP = "vllm_omni/diffusion/distributed/hsdp.py"


def test_the_coordinator_routes_its_collectives_through_the_platform_and_registers_every_instance(patched):
    coordinator = (patched / COORDINATOR).read_text()
    for name in ("all_reduce", "all_gather", "broadcast"):
        assert f"    {name} = persistent_collectives.coordinator_{name}\n" in coordinator
        assert f"    def {name}(" not in coordinator
    # GroupCoordinator's and PipelineGroupCoordinator's own __init__ (the latter calls no super().__init__)
    assert coordinator.count("persistent_collectives.register_coordinator(self)") == 2


def test_every_collective_site_of_the_patched_tree_is_routed_or_reviewed_without_the_plugin(patched, capsys):
    assert reach.main(["--tree", str(patched / "vllm_omni" / "diffusion"), "--without-plugin"]) == 0, (
        capsys.readouterr().err
    )


def test_hsdp_shards_with_the_persistent_fully_shard(patched):
    assert "from vllm_omni.distributed.persistent_fsdp import fully_shard" in (patched / HSDP).read_text()


def test_the_worker_starts_and_loads_with_plain_collectives_and_installs_nothing_process_wide(patched):
    worker = (patched / WORKER).read_text()
    assert worker.count("persistent_collectives.unstaged()") == 2  # around init_device, inside load_model
    assert "install_persistent_collectives" not in worker


def _added_non_test_lines(patch) -> int:
    added, current = 0, ""
    for line in patch.read_text().splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/")[-1]
        elif (
            line.startswith("+")
            and not line.startswith("+++")
            and line[1:].strip()
            and not current.startswith("tests/")
        ):
            added += 1
    return added


@pytest.mark.parametrize("index", range(len(upstream_patches.patch_files())))
def test_each_patch_adds_at_most_360_non_test_lines_so_it_reads_in_one_sitting(index):
    assert 0 < _added_non_test_lines(upstream_patches.patch_files()[index]) <= 360


def test_there_are_nine_patches_vae_whole_request_cost_contract_modules_kinds_errors_pool_order_pool_alone():
    names = [patch.name for patch in upstream_patches.patch_files()]
    assert [name[:4] for name in names] == [f"{index:04d}" for index in range(1, 10)]
    assert "MiniMax-H3" in names[0] and "request-path" in names[1] and "Persistent-collectives-at-the-cost" in names[2]
    assert "Every-diffusion-module" in names[3] and "Stage-every-collective-kind" in names[4]
    assert "an-error-frees-its-bl" in names[5] and "Pool-mode" in names[6] and "program-order" in names[7]
    assert "Pool-mode-on-its-own" in names[8]


@pytest.mark.parametrize("relative", upstream_patches.CARRIED)
def test_the_patch_carries_this_checkouts_file_as_it_is_now(patched, relative):
    # A change here that is not in the patch: python -m tooling.upstream_patches regenerate
    assert (patched / relative).read_bytes() == (REPO_ROOT / relative).read_bytes(), relative


def test_the_patch_tests_and_the_serve_test_pass_in_the_patched_tree_with_the_plugin_off(patched):
    assert upstream_patches.run_against(patched) == 0


def test_a_patch_that_no_longer_applies_names_the_file_and_the_hunk(tmp_path):
    patch = upstream_patches.patch_files()[0]
    text = patch.read_text()
    context = "\n         self.device_module = torch.get_device_module()\n"  # a context line of the vae.py hunk
    assert context in text
    broken = tmp_path / patch.name
    broken.write_text(text.replace(context, context.replace("device_module =", "device_module_moved =")))
    tree = upstream_patches.pristine_tree(tmp_path / "tree")
    with pytest.raises(SystemExit) as failed:
        upstream_patches.apply_patches(tree, [broken])
    message = str(failed.value)
    assert message.startswith(f"{patch.name} no longer applies to vLLM-Omni 0.30.0")
    assert f"patch failed: {ADAPTER}:" in message
