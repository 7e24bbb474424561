# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
from tests.distributed import ranks
from tests.utils import use_working_tree

# Before any test module imports vae_gather: the checkout under test, never a stale installed copy; in every rank
# too (the server they fork from imports tests/working_tree.py first).
use_working_tree()
ranks.PRELOAD = ("tests.working_tree",)


def pytest_addoption(parser):
    parser.addoption(
        "--full-census",
        action="store_true",
        help="also run the census layouts marked full_census (each serves two pipelines on four ranks)",
    )


# Patch 1's tests of what it edits in release files (the adapter's own __init__, the diffusion envs): on a release
# the plugin installs the gather (tests/diffusion/models/minimax_h3/test_vae_gather_adapter.py, on gloo ranks).
_PATCHED_TREE_ONLY = (
    "test_vae_gather.py::test_the_adapters_own_init_installs_the_gather_as_the_switch_says",
    "test_vae_gather.py::test_the_diffusion_envs_declare_the_switch_the_gather_reads",
)


def pytest_collection_modifyitems(config, items):
    import pytest

    if adapter_tests := [item for item in items if any(test in item.nodeid for test in _PATCHED_TREE_ONLY)]:
        from vllm_omni.diffusion.models.minimax_h3 import vae

        if not hasattr(vae, "install_tile_gather_reuse"):
            skip = pytest.mark.skip(reason="a release: the plugin installs the gather, not the adapter's __init__")
            for item in adapter_tests:
                item.add_marker(skip)
    if config.getoption("--full-census"):
        return
    skip = pytest.mark.skip(reason="a census layout beyond CI's: run with --full-census")
    for item in items:
        if "full_census" in item.keywords:
            item.add_marker(skip)
