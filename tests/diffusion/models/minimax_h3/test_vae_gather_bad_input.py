# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Bad input and injected faults in one process (ranks are threads, the collective a recorder).

The same cases on real gloo ranks, where a rank left behind would hang, are in test_vae_gather_faults.py.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

from vllm_omni.diffusion.models.minimax_h3 import vae_gather
from vllm_omni.diffusion.models.minimax_h3.vae_gather import get_tile_gather, install_tile_gather_reuse

from .fake_collective import ThreadWorld
from .stand_ins import (
    TILE_SHAPE,
    StandInAdapter,
    gather_on_every_rank,
    make_share,
    make_tile,
    oracle_gather,
    ranks_with_gather,
)

pytestmark = [
    pytest.mark.core_model,
    pytest.mark.cpu,
    pytest.mark.diffusion,
    pytest.mark.usefixtures("fake_collective"),
]


def _gather_each(world, adapters, shares, num_tiles):
    """Every rank gathers its own (possibly bad) share; returns each rank's tiles or exception."""

    def one_rank(rank):
        try:
            return adapters[rank].model._all_gather_tiled_results(shares[rank], num_tiles)
        except Exception as exc:  # noqa: BLE001 - the outcome per rank is what the tests compare
            return exc

    return world.run(one_rank)


def _same_error_everywhere(outcomes, kind, pattern):
    assert all(isinstance(o, kind) for o in outcomes), outcomes
    messages = {str(o) for o in outcomes}
    assert len(messages) == 1, messages
    assert re.search(pattern, messages.pop())


@pytest.mark.parametrize("num_tiles", [3, 0, -1, 8.0, True, "8", None])
def test_num_tiles_that_leaves_a_rank_without_tiles_or_is_no_int_raises_before_any_collective(num_tiles):
    world = ThreadWorld(4)
    adapters = ranks_with_gather(world)
    shares = [make_share(r, 4, 4) for r in range(4)]
    outcomes = _gather_each(world, adapters, shares, num_tiles)
    _same_error_everywhere(outcomes, ValueError, re.escape(f"num_tiles={num_tiles!r} over sp_size=4"))
    assert world.calls == []


@pytest.mark.parametrize(
    "bad_rank_share,pattern",
    [
        (lambda share: share + [make_tile(99)], r"rank 1 holds 3 tile\(s\), expected 2"),
        (lambda share: [], r"rank 1 holds 0 tile\(s\), expected 2"),
        (lambda share: share[:1], r"rank 1 holds 1 tile\(s\), expected 2"),
        (lambda share: [share[0], make_tile(7, shape=(3, 2, 4, 5))], r"rank\(s\) \[1\] hold tiles that are not"),
        (lambda share: [share[0], share[1].to(torch.bfloat16)], r"rank\(s\) \[1\] hold tiles that are not"),
        (lambda share: [share[0], share[1].to("meta")], r"rank\(s\) \[1\] hold tiles that are not"),
        (lambda share: [share[0], "tile"], r"rank\(s\) \[1\] hold tiles that are not"),
        (lambda share: [t.to(torch.bfloat16) for t in share], r"different dtypes \['torch.float32', 'torch.bfloat16'"),
    ],
    ids=[
        "extra-tile",
        "empty",
        "missing-tile",
        "mixed-shapes",
        "mixed-dtypes",
        "mixed-devices",
        "not-a-tensor",
        "dtype-differs-across-ranks",
    ],
)
def test_a_bad_share_on_one_rank_raises_the_same_error_on_every_rank(bad_rank_share, pattern):
    world = ThreadWorld(4)
    adapters = ranks_with_gather(world)
    shares = [make_share(r, 4, 8) for r in range(4)]
    shares[1] = bad_rank_share(shares[1])
    _same_error_everywhere(_gather_each(world, adapters, shares, 8), ValueError, pattern)
    # Still in step: the next good gather works on every rank.
    for tiles in gather_on_every_rank(world, adapters, 8):
        assert all(
            torch.equal(t, w)
            for t, w in zip(tiles, oracle_gather([make_share(r, 4, 8) for r in range(4)], 8), strict=True)
        )


def test_shapes_that_differ_across_ranks_send_every_rank_to_the_checkpoint_gather_with_one_warning(gather_log):
    world = ThreadWorld(2)
    adapters = ranks_with_gather(world)
    for _ in range(2):
        shares = [make_share(0, 2, 4), make_share(1, 2, 4, shape=(3, 2, 4, 8))]
        outcomes = _gather_each(world, adapters, shares, 4)
    assert outcomes == [["checkpoint gather"] * 4] * 2
    assert all(a.model.own_gather_calls == 2 and get_tile_gather(a).stats()["fallbacks"] == 2 for a in adapters)
    warnings = gather_log.messages(logging.WARNING)
    assert len(warnings) == 2 and all("different shapes" in w for w in warnings)  # one per rank, not per call


def test_non_contiguous_tiles_gather_bit_for_bit():
    world = ThreadWorld(4)
    adapters = ranks_with_gather(world)
    shares = [[t.transpose(-1, -2) for t in make_share(r, 4, 9)] for r in range(4)]
    assert not shares[0][0].is_contiguous()
    for tiles in _gather_each(world, adapters, shares, 9):
        assert all(torch.equal(t, w) for t, w in zip(tiles, oracle_gather(shares, 9), strict=True))


def test_zero_element_tiles_come_back_empty_without_a_payload_collective():
    world = ThreadWorld(4)
    adapters = ranks_with_gather(world)
    shares = [make_share(r, 4, 6, shape=(3, 0, 4, 4)) for r in range(4)]
    for tiles in _gather_each(world, adapters, shares, 6):
        assert len(tiles) == 6 and all(t.shape == (3, 0, 4, 4) for t in tiles)
    assert len(world.calls) == 4  # the header exchange only


def test_tiles_on_another_device_than_the_workspace_move_it_there_with_a_warning(gather_log):
    world = ThreadWorld(2)
    adapters = ranks_with_gather(world)
    for adapter in adapters:  # a workspace on another device ("meta" stands in for another card)
        get_tile_gather(adapter).reserve(TILE_SHAPE, torch.float32, 4, device="meta")
    outcomes = gather_on_every_rank(world, adapters, 4)
    shares = [make_share(r, 2, 4) for r in range(2)]
    for tiles in outcomes:
        assert all(torch.equal(t, w) for t, w in zip(tiles, oracle_gather(shares, 4), strict=True))
    assert all(get_tile_gather(a).workspace.device.type == "cpu" for a in adapters)
    assert all(get_tile_gather(a).stats()["allocs"] == 2 for a in adapters)
    moved = [m for m in gather_log.messages(logging.WARNING) if "tiles moved from meta to cpu" in m]
    assert len(moved) == 2


def test_single_rank_with_a_wrong_share_raises():
    adapter = StandInAdapter()
    install_tile_gather_reuse(adapter, enabled=True)
    with pytest.raises(ValueError, match="sp_size=1 expects all 3 tiles.*got 2"):
        adapter.model._all_gather_tiled_results(make_share(0, 1, 2), 3)


@pytest.mark.parametrize(
    "state,pattern",
    [
        ({}, "lacks sp_size, sp_rank or sp_process_group"),
        (None, "lacks sp_size, sp_rank or sp_process_group"),
        ({"sp_size": 4, "sp_rank": 0}, "lacks sp_size, sp_rank or sp_process_group"),
        ({"sp_size": "4", "sp_rank": 0, "sp_process_group": None}, r"sp_size='4', sp_rank=0; expected ints"),
        ({"sp_size": 4, "sp_rank": 4, "sp_process_group": None}, "sp_size=4, sp_rank=4; expected ints"),
        ({"sp_size": 0, "sp_rank": 0, "sp_process_group": None}, "sp_size=0, sp_rank=0; expected ints"),
        ({"sp_size": 4, "sp_rank": 1, "sp_process_group": None}, "sp_process_group is None; initialise torch.dist"),
        ({"sp_size": 2, "sp_rank": 1, "sp_process_group": ThreadWorld(4).group(1)}, "has 4 ranks but sp_size=2"),
    ],
)
def test_missing_or_malformed_parallel_state_is_a_clear_error(state, pattern):
    adapter = StandInAdapter()
    adapter.state = state
    install_tile_gather_reuse(adapter, enabled=True)
    with pytest.raises(RuntimeError, match=pattern):
        adapter.model._all_gather_tiled_results(make_share(0, 1, 4), 4)


@pytest.mark.parametrize(
    "adapter,pattern",
    [
        (object(), "got object without .model"),
        (type("Adapter", (), {"model": torch.nn.Linear(1, 1)})(), "Linear has no method _all_gather_tiled_results"),
    ],
)
def test_install_on_something_that_is_not_the_adapter_is_a_clear_error(adapter, pattern):
    with pytest.raises(TypeError, match=pattern):
        install_tile_gather_reuse(adapter, enabled=True)


@pytest.mark.parametrize(
    "first_num_tiles",
    [
        pytest.param(9, id="fails-in-the-one-exchange"),  # call 2 fits call 1's slot: its only exchange fails
        pytest.param(5, id="fails-in-the-payload-exchange"),  # call 2 is larger: its second exchange fails
    ],
)
def test_a_collective_failing_mid_call_leaves_the_next_call_correct_and_the_workspace_intact(first_num_tiles):
    world = ThreadWorld(4, fail_on_call=2 if first_num_tiles == 9 else 3)
    adapters = ranks_with_gather(world)
    gather_on_every_rank(world, adapters, first_num_tiles)
    for adapter in adapters:
        get_tile_gather(adapter).reserve(TILE_SHAPE, torch.float32, 9)
    before = [(get_tile_gather(a).workspace.data_ptr, get_tile_gather(a).stats()["allocs"]) for a in adapters]
    with pytest.raises(RuntimeError, match="injected collective failure"):
        gather_on_every_rank(world, adapters, 9, salt=1)
    shares = [make_share(r, 4, 9, salt=2) for r in range(4)]
    for tiles in gather_on_every_rank(world, adapters, 9, salt=2):
        assert all(torch.equal(t, w) for t, w in zip(tiles, oracle_gather(shares, 9), strict=True))
    after = [(get_tile_gather(a).workspace.data_ptr, get_tile_gather(a).stats()["allocs"]) for a in adapters]
    assert after == before  # neither reallocated (leaked) nor dropped


def test_an_allocation_failure_falls_back_to_the_checkpoint_gather_on_every_rank(monkeypatch):
    world = ThreadWorld(2)
    adapters = ranks_with_gather(world)
    real = vae_gather.allocate_bytes
    failures = []

    def fail_large_on_rank_1(nbytes, device, group):
        if group.rank() == 1 and nbytes > 2 * vae_gather._HEADER_BYTES and not failures:
            failures.append(nbytes)
            raise torch.OutOfMemoryError("injected: out of device memory")
        return real(nbytes, device, group)

    monkeypatch.setattr(vae_gather, "allocate_bytes", fail_large_on_rank_1)
    assert gather_on_every_rank(world, adapters, 4) == [["checkpoint gather"] * 4] * 2
    assert [a.model.own_gather_calls for a in adapters] == [1, 1]
    shares = [make_share(r, 2, 4) for r in range(2)]
    for tiles in gather_on_every_rank(world, adapters, 4):  # the next request allocates and succeeds
        assert all(torch.equal(t, w) for t, w in zip(tiles, oracle_gather(shares, 4), strict=True))


def test_tiles_that_require_grad_on_one_rank_gather_like_the_others():
    world = ThreadWorld(4)
    adapters = ranks_with_gather(world)
    shares = [make_share(r, 4, 9) for r in range(4)]
    shares[3] = [t.clone().requires_grad_() for t in shares[3]]
    for tiles in _gather_each(world, adapters, shares, 9):
        assert all(torch.equal(t, w) for t, w in zip(tiles, oracle_gather(shares, 9), strict=True))
