# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The address-stable tile gather on four real gloo ranks, against the checkpoint's variable-shape list gather.

The ranks start once per module and run every check; each test asserts one property of what they reported.
"""

from __future__ import annotations

import pytest
import torch

from tests.utils import results_or_raise, run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.parallel]

WORLD = 4
NUM_TILES = (4, 5, 8, 9, 28)
DTYPES = (torch.float32, torch.bfloat16)
TILE_SHAPE = (3, 8, 16, 16)


def _checks_on_one_rank(rank: int, world: int) -> dict:
    import types

    from tests.diffusion.models.minimax_h3.gloo_checkpoint import checkpoint_on_gloo_rank
    from tests.diffusion.models.minimax_h3.stand_ins import make_share, make_tile
    from vllm_omni.diffusion.models.minimax_h3.vae_gather import install_tile_gather_reuse

    adapter = checkpoint_on_gloo_rank(rank, world)
    checkpoint = adapter.model
    assert install_tile_gather_reuse(adapter, enabled=True)
    ours = checkpoint._all_gather_tiled_results
    checkpoints_own = types.MethodType(type(checkpoint)._all_gather_tiled_results, checkpoint)
    report: dict = {"equal_to_checkpoint": {}, "equal_to_oracle": {}}

    for dtype in DTYPES:
        for num_tiles in NUM_TILES:
            share = make_share(rank, world, num_tiles, shape=TILE_SHAPE, dtype=dtype)
            expected = checkpoints_own(share, num_tiles)
            got = ours(share, num_tiles)
            key = f"{num_tiles}/{dtype}"
            report["equal_to_checkpoint"][key] = _equal(got, expected)
            oracle = [make_tile(i, shape=TILE_SHAPE, dtype=dtype) for i in range(num_tiles)]
            report["equal_to_oracle"][key] = _equal(got, oracle)

    from xpu_collective_memory.ledger import CollectiveLedger

    for label, gather in (("ours", ours), ("checkpoint", checkpoints_own)):
        with CollectiveLedger(limit=None) as ledger:  # pins what it sees: freed memory cannot come back
            for call in range(5):
                gather(make_share(rank, world, 28, shape=TILE_SHAPE, salt=call), 28)
                ledger.end_request()
        report[label] = [r.as_dict() for r in ledger.requests]

    return report


def _equal(got, want) -> bool:
    from tests.diffusion.models.minimax_h3.stand_ins import assert_tiles_equal

    try:
        assert_tiles_equal(got, want)
    except AssertionError:
        return False
    return True


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return results_or_raise(run_ranks(_checks_on_one_rank, WORLD, timeout_s=300, pg_timeout_s=60), WORLD)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tiles", NUM_TILES)
def test_every_rank_gets_the_checkpoints_tiles_bit_for_bit(reports, num_tiles, dtype):
    for rank, report in enumerate(reports):
        assert report["equal_to_checkpoint"][f"{num_tiles}/{dtype}"], f"rank {rank}"
        assert report["equal_to_oracle"][f"{num_tiles}/{dtype}"], f"rank {rank}"


def test_collective_sees_no_new_allocation_after_the_first_call_and_send_is_receive(reports):
    for rank, report in enumerate(reports):
        calls = report["ours"]
        # The first call registers its two allocations (workspace, headers), each used for send and receive.
        first = {side for by_side in calls[0]["new_by_site"].values() for side in by_side}
        assert first == {"send+recv"} and calls[0]["new_registrations"] == 2, f"rank {rank}: {calls[0]}"
        assert [c["new_registrations"] for c in calls[1:]] == [0] * 4, f"rank {rank}"
        assert calls[-1]["registrations"] == calls[0]["new_registrations"]


def test_checkpoint_gather_hands_the_collective_new_allocations_every_call(reports):
    # The same ledger sees the leak's cause in the stock gather, so the previous test can fail.
    for report in reports:
        for call in report["checkpoint"]:
            sides = [side for by_side in call["new_by_site"].values() for side in by_side]
            assert call["new_registrations"] >= 2 and "send" in sides
