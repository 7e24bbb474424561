# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""For the gloo-rank tests: the synthetic checkpoint's real autoencoder behind an adapter-shaped object."""

from __future__ import annotations

import torch


def checkpoint_on_gloo_rank(rank: int, world: int):
    """On a gloo rank of its own: the synthetic checkpoint's autoencoder (its gather is the checkpoint's
    variable-shape list gather) behind an adapter-shaped object, parallel state filled as the adapter does."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from tooling.synthetic.remote_code import klvae, parallel

    checkpoint = klvae.AutoencoderKL(4, 8, 8, 4, 2, 64, 16, True)
    parallel.get_parallel_state().update(
        sp_size=world, sp_rank=rank, sp_process_group=dist.group.WORLD, sp_enabled=True
    )
    return SimpleNamespace(
        model=checkpoint, _device_target=torch.device("cpu"), _native_parallel_state=parallel.get_parallel_state
    )
