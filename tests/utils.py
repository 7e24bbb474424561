# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Test plumbing: run the working tree's modules, in this process and in every rank it starts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Re-exported; ranks put the working tree first through the runner's PRELOAD, which tests/conftest.py sets.
from tests.distributed.ranks import results_or_raise, run_ranks  # noqa: F401
from tooling.upstream_patches import TREE_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO_ROOT / "vllm_omni" / "diffusion" / "models" / "minimax_h3"
DISTRIBUTED_DIR = REPO_ROOT / "vllm_omni" / "distributed"


def use_working_tree() -> None:
    """Make ``vae_gather`` and our ``vllm_omni.distributed`` modules resolve to this checkout, not an installed copy.

    With a released vLLM-Omni installed, its ``minimax_h3`` is a regular package and our folder (no
    ``__init__.py``, by design) is ignored; putting the folder first on the package's ``__path__`` fixes that.
    With ``VLLM_OMNI_TEST_UPSTREAM_TREE`` set, the code under test is that patched vLLM-Omni tree instead.
    """
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import vllm_omni.diffusion.models.minimax_h3 as package
    import vllm_omni.distributed as distributed

    if (tree := os.environ.get(TREE_ENV)) is not None:
        if not Path(package.__file__).resolve().is_relative_to(Path(tree).resolve()):
            raise RuntimeError(f"{TREE_ENV}={tree!r}, but vllm_omni comes from {package.__file__}; put the tree first")
        return

    for pkg, directory, module in (
        (package, MODEL_DIR, "vae_gather"),
        (distributed, DISTRIBUTED_DIR, "collective_workspaces"),
        (distributed, DISTRIBUTED_DIR, "persistent_collectives"),
        (distributed, DISTRIBUTED_DIR, "managed_distributed"),
        (distributed, DISTRIBUTED_DIR, "traced_collectives"),
        (distributed, DISTRIBUTED_DIR, "persistent_fsdp"),
    ):
        if str(directory) not in pkg.__path__:
            pkg.__path__.insert(0, str(directory))
        stale = sys.modules.get(f"{pkg.__name__}.{module}")
        if stale is not None and Path(stale.__file__).resolve().parent != directory:
            raise RuntimeError(f"{module} was imported from {stale.__file__} before the working tree was put first")
