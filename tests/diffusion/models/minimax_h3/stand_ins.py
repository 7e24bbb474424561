# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Stand-ins for the adapter and the checkpoint in single-process tests, plus tile builders and the oracle.

The real MiniMaxH3VideoVAE and a real checkpoint are exercised by the integration tests; here only the
surface the gather touches is needed: ``adapter.model``, ``adapter._device_target`` and the parallel state.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .fake_collective import ThreadWorld

TILE_SHAPE = (3, 2, 4, 4)


class StandInCheckpoint(torch.nn.Module):
    """The checkpoint's AutoencoderKL, reduced to its gather; calls to the checkpoint's own gather are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.own_gather_calls = 0

    def _all_gather_tiled_results(self, tasks: list[torch.Tensor], num_tiles: int) -> list[Any]:
        self.own_gather_calls += 1
        return ["checkpoint gather"] * num_tiles


class StandInAdapter:
    def __init__(self, device: str = "cpu", state: dict[str, Any] | None = None) -> None:
        self.model = StandInCheckpoint()
        self._device_target = torch.device(device)
        self.state = state if state is not None else {"sp_size": 1, "sp_rank": 0, "sp_process_group": None}

    def _native_parallel_state(self) -> dict[str, Any]:
        return self.state


def ranks_with_gather(world: ThreadWorld) -> list[StandInAdapter]:
    # Imported here, where it is used: a process that only builds stand-ins never loads the gather.
    from vllm_omni.diffusion.models.minimax_h3.vae_gather import install_tile_gather_reuse

    adapters = []
    for rank in range(world.size):
        state = {"sp_size": world.size, "sp_rank": rank, "sp_process_group": world.group(rank), "sp_enabled": True}
        adapter = StandInAdapter(state=state)
        assert install_tile_gather_reuse(adapter, enabled=True)
        adapters.append(adapter)
    return adapters


def make_tile(index: int, shape=TILE_SHAPE, dtype: torch.dtype = torch.float32, salt: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * salt + index)
    return torch.randn(shape, generator=generator).to(dtype)


def make_share(rank: int, world_size: int, num_tiles: int, **kwargs: Any) -> list[torch.Tensor]:
    """Rank ``rank``'s tiles in the checkpoint's round-robin ownership: ``range(rank, num_tiles, world_size)``."""
    return [make_tile(g, **kwargs) for g in range(rank, num_tiles, world_size)]


def oracle_gather(shares: list[list[torch.Tensor]], num_tiles: int) -> list[torch.Tensor]:
    """The contract, written out: global tile ``k * sp_size + r`` is rank r's k-th tile."""
    sp_size = len(shares)
    return [shares[g % sp_size][g // sp_size] for g in range(num_tiles)]


def assert_tiles_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Same number of tiles, and each bit-identical (dtype and shape included) to the one expected."""
    assert len(got) == len(want), f"{len(got)} tiles, expected {len(want)}"
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), f"tile {index} differs"


def gather_on_every_rank(world: ThreadWorld, adapters, num_tiles: int, **kwargs: Any) -> list[list[torch.Tensor]]:
    def one_rank(rank: int) -> list[torch.Tensor]:
        share = make_share(rank, world.size, num_tiles, **kwargs)
        return adapters[rank].model._all_gather_tiled_results(share, num_tiles)

    return world.run(one_rank)


class RecordingHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]
