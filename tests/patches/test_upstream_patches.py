# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The upstream patches against a pristine vLLM-Omni 0.30.0 package tree, fetched from the package index.

They must apply, carry this checkout's files as they are now, and pass the patches' own tests, the layer's
tests and the ``vllm-omni serve`` test in that tree with this project's plugin switched off: the adapter's and
the diffusion worker's own calls install the fixes there.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest

from minimax_h3_bench import upstream_patches
from tests.utils import REPO_ROOT

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


def test_the_diffusion_worker_installs_the_collectives_layer_once_its_group_is_up(patched):
    worker = (patched / WORKER).read_text()
    assert worker.count("install_persistent_collectives()") == 1
    assert worker.index("init_distributed_environment(world_size") < worker.index("install_persistent_collectives()")


def test_there_are_two_patches_the_vae_one_then_the_whole_request_one():
    names = [patch.name for patch in upstream_patches.patch_files()]
    assert [name[:4] for name in names] == ["0001", "0002"]
    assert "MiniMax-H3" in names[0] and "collective" in names[1]


@pytest.mark.parametrize("relative", upstream_patches.CARRIED)
def test_the_patch_carries_this_checkouts_file_as_it_is_now(patched, relative):
    # A change here that is not in the patch: python -m minimax_h3_bench.upstream_patches regenerate
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
