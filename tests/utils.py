# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Test plumbing: run the working tree's modules, in this process and in every spawned rank."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from minimax_h3_bench import ranks
from minimax_h3_bench.upstream_patches import TREE_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO_ROOT / "vllm_omni" / "diffusion" / "models" / "minimax_h3"


def use_working_tree() -> None:
    """Make ``vllm_omni.diffusion.models.minimax_h3.vae_gather`` resolve to this checkout, not an installed copy.

    With a released vLLM-Omni installed, its ``minimax_h3`` is a regular package and our folder (no
    ``__init__.py``, by design) is ignored; putting the folder first on the package's ``__path__`` fixes that.
    With ``VLLM_OMNI_H3_UPSTREAM_TREE`` set, the code under test is that patched vLLM-Omni tree instead.
    """
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import vllm_omni.diffusion.models.minimax_h3 as package

    if (tree := os.environ.get(TREE_ENV)) is not None:
        if not Path(package.__file__).resolve().is_relative_to(Path(tree).resolve()):
            raise RuntimeError(f"{TREE_ENV}={tree!r}, but vllm_omni comes from {package.__file__}; put the tree first")
        return

    if str(MODEL_DIR) not in package.__path__:
        package.__path__.insert(0, str(MODEL_DIR))
    stale = sys.modules.get(f"{package.__name__}.vae_gather")
    if stale is not None and Path(stale.__file__).resolve().parent != MODEL_DIR:
        raise RuntimeError(f"vae_gather was imported from {stale.__file__} before the working tree was put first")


run_ranks = functools.partial(ranks.run_ranks, prepare=use_working_tree)
results_or_raise = ranks.results_or_raise
