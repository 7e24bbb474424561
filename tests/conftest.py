# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
from tests.distributed import ranks
from tests.utils import use_working_tree

# Before any test module imports vae_gather: the checkout under test, never a stale installed copy; in every
# spawned rank too.
use_working_tree()
ranks.PREPARE = use_working_tree


def pytest_addoption(parser):
    parser.addoption(
        "--full-census",
        action="store_true",
        help="also run the census layouts marked full_census (each serves two pipelines on four ranks)",
    )


def pytest_collection_modifyitems(config, items):
    import pytest

    if config.getoption("--full-census"):
        return
    skip = pytest.mark.skip(reason="a census layout beyond CI's: run with --full-census")
    for item in items:
        if "full_census" in item.keywords:
            item.add_marker(skip)
