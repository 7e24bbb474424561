# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Bad input and injected faults on four real gloo ranks: whatever one rank gets wrong, no peer is left blocked.

One spawn runs every case in turn; after each, a good gather proves the ranks are still in step. The last
case (a peer that never reaches the gather) spends the process group, so it runs last.
"""

from __future__ import annotations

import pytest

from tests.utils import results_or_raise, run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.distributed]

WORLD = 4
NUM_TILES = 9
PG_TIMEOUT_S = 15
SHAPE = (3, 8, 16, 16)
CASES = (
    "extra-tile",
    "empty-share",
    "mixed-shapes-in-share",
    "mixed-dtypes-in-share",
    "dtype-differs-across-ranks",
    "shape-differs-across-ranks",
    "allocation-fails-on-one-rank",
    "num-tiles-below-sp-size",
)


def _num_tiles(case: str) -> int:
    return {"num-tiles-below-sp-size": 3, "allocation-fails-on-one-rank": 28}.get(case, NUM_TILES)


def _share_for(case: str, rank: int, world: int):
    import torch

    from tests.diffusion.models.minimax_h3.stand_ins import make_share, make_tile

    share = make_share(rank, world, _num_tiles(case), shape=SHAPE)
    if rank != 2:
        return share
    if case == "extra-tile":
        return share + [make_tile(99, shape=SHAPE)]
    if case == "empty-share":
        return []
    if case == "mixed-shapes-in-share":
        return [share[0], make_tile(99, shape=(3, 8, 16, 8))]
    if case == "mixed-dtypes-in-share":
        return [share[0], share[1].to(torch.bfloat16)]
    if case == "dtype-differs-across-ranks":
        return [t.to(torch.bfloat16) for t in share]
    if case == "shape-differs-across-ranks":
        return make_share(rank, world, NUM_TILES, shape=(3, 8, 16, 8))
    return share


def _cases_on_one_rank(rank: int, world: int) -> dict:
    import logging
    import time

    import torch

    from tests.diffusion.models.minimax_h3.stand_ins import (
        RecordingHandler,
        checkpoint_on_gloo_rank,
        make_share,
        make_tile,
    )
    from vllm_omni.diffusion.models.minimax_h3 import vae_gather

    adapter = checkpoint_on_gloo_rank(rank, world)
    vae_gather.install_tile_gather_reuse(adapter, enabled=True)
    gather = adapter.model._all_gather_tiled_results
    handler = RecordingHandler()
    logging.getLogger(vae_gather.__name__).addHandler(handler)
    real_allocate = vae_gather.allocate_bytes
    outcomes: dict = {}

    for case in CASES:
        if case == "allocation-fails-on-one-rank" and rank == 2:
            held = vae_gather.get_tile_gather(adapter).workspace.nbytes

            def out_of_memory(nbytes, device, group, held=held):  # growing fails; what was held fits again
                if nbytes > held:
                    raise torch.OutOfMemoryError("injected: out of device memory")
                return real_allocate(nbytes, device, group)

            vae_gather.allocate_bytes = out_of_memory
        share = _share_for(case, rank, world)
        num_tiles = _num_tiles(case)
        start = time.monotonic()
        try:
            tiles = gather(share, num_tiles)
            expected = [_share_for(case, g % world, world)[g // world] for g in range(num_tiles)]
            outcome = ("ok", all(torch.equal(t, e) for t, e in zip(tiles, expected, strict=True)))
        except Exception as exc:  # noqa: BLE001 - compared across ranks by the test
            outcome = (type(exc).__name__, str(exc))
        vae_gather.allocate_bytes = real_allocate
        after = gather(make_share(rank, world, NUM_TILES, shape=SHAPE), NUM_TILES)
        in_step = all(torch.equal(t, make_tile(g, shape=SHAPE)) for g, t in enumerate(after))
        outcomes[case] = (*outcome, in_step, time.monotonic() - start)

    warnings = handler.messages(logging.WARNING)
    stats = vae_gather.get_tile_gather(adapter).stats()

    # A peer that fails before the gather and never joins it: the others wait out the group's timeout.
    start = time.monotonic()
    try:
        if rank == 1:
            raise RuntimeError("injected: rank 1 failed before the gather")
        gather(make_share(rank, world, NUM_TILES, shape=SHAPE), NUM_TILES)
        peer = ("ok", "")
    except Exception as exc:  # noqa: BLE001
        peer = (type(exc).__name__, str(exc)[:300])
    if rank == 1:
        time.sleep(PG_TIMEOUT_S + 5)  # stay in the group, as a stuck peer would, past the others' timeout
    return {"outcomes": outcomes, "warnings": warnings, "stats": stats, "peer": (*peer, time.monotonic() - start)}


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    reported = run_ranks(_cases_on_one_rank, WORLD, timeout_s=360, pg_timeout_s=PG_TIMEOUT_S)
    return results_or_raise(reported, WORLD)


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("extra-tile", r"rank 2 holds 3 tile\(s\), expected 2"),
        ("empty-share", r"rank 2 holds 0 tile\(s\), expected 2"),
        ("mixed-shapes-in-share", r"rank\(s\) \[2\] hold tiles that are not tensors of one shape"),
        ("mixed-dtypes-in-share", r"rank\(s\) \[2\] hold tiles that are not tensors of one shape"),
        ("dtype-differs-across-ranks", r"different dtypes"),
        ("num-tiles-below-sp-size", r"num_tiles=3 over sp_size=4"),
    ],
    ids=lambda value: value if value in CASES else "",
)
def test_bad_input_on_one_rank_raises_the_same_value_error_on_every_rank_and_nobody_hangs(reports, case, pattern):
    import re

    outcomes = [r["outcomes"][case] for r in reports]
    assert {(kind, message) for kind, message, _, _ in outcomes} == {("ValueError", outcomes[0][1])}
    assert re.search(pattern, outcomes[0][1])
    assert all(in_step and seconds < PG_TIMEOUT_S for _, _, in_step, seconds in outcomes)


@pytest.mark.parametrize("case", ["shape-differs-across-ranks", "allocation-fails-on-one-rank"])
def test_every_rank_falls_back_to_the_checkpoint_gather_together_and_gets_correct_tiles(reports, case):
    outcomes = [r["outcomes"][case] for r in reports]
    assert all(kind == "ok" and correct and in_step for kind, correct, in_step, _ in outcomes)


def test_each_fallback_reason_is_warned_once_per_rank(reports):
    for report in reports:
        assert report["stats"]["fallbacks"] == 2
        assert len(report["warnings"]) == 2
        assert any("different shapes" in w for w in report["warnings"])
        assert any("workspace allocation failed on rank(s) [2]" in w for w in report["warnings"])


def test_a_peer_failing_before_the_gather_leaves_no_rank_blocked_past_the_group_timeout(reports):
    assert reports[1]["peer"][:2] == ("RuntimeError", "injected: rank 1 failed before the gather")
    for rank in (0, 2, 3):
        kind, _, seconds = reports[rank]["peer"]
        assert kind != "ok" and PG_TIMEOUT_S - 1 <= seconds <= PG_TIMEOUT_S + 10, reports[rank]["peer"]
