# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""This checkout's own: what of ``tests/distributed`` runs here, on a released vLLM-Omni with the plugin's routing.

These files go upstream whole, each in the patch that owns it, and ``tooling.upstream_patches`` runs each in the
pristine 0.30.0 tree with its patch and the ones before it. Here run only the tests of release modules (the
coordinator, Ulysses' and Ring's exchange), routed in every rank as the plugin routes them: the tests of the modules
the patches carry whole run there, on the same files under the same torch.
"""

import os

import pytest

from tests.distributed import ranks
from tests.utils import prepare_release_ranks
from tooling.upstream_patches import TREE_ENV

RELEASE = os.environ.get(TREE_ENV) is None  # not a patched tree: the release this checkout's stack installs

if RELEASE:
    collect_ignore = [
        "test_persistent_collectives.py",
        "test_managed_distributed.py",
        "test_persistent_fsdp.py",
        "test_program_order.py",
        "test_request_pool.py",
    ]


@pytest.fixture(scope="module", autouse=True)
def routed_release_ranks():
    saved = ranks.PREPARE
    if RELEASE:
        ranks.PREPARE = prepare_release_ranks
    yield
    ranks.PREPARE = saved
