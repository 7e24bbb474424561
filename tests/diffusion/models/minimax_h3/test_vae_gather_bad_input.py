# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Bad input and injected faults in one process: ranks are threads, the collective a recorder.

The same case table runs on real gloo ranks, where a rank left behind would hang, in test_vae_gather_faults.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from vllm_omni.diffusion.models.minimax_h3 import vae_gather
from vllm_omni.diffusion.models.minimax_h3.vae_gather import get_tile_gather, install_tile_gather_reuse
from vllm_omni.distributed import collective_workspaces

from .bad_input_cases import CASES, NUM_TILES, SHAPE, WORLD, inputs_for
from .fake_collective import ThreadWorld
from .stand_ins import (
    StandInAdapter,
    assert_tiles_equal,
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


def _gather_each(world, adapters, inputs):
    """Every rank gathers its own (possibly bad) input; returns each rank's tiles or exception."""

    def one_rank(rank):
        try:
            return adapters[rank].model._all_gather_tiled_results(*inputs[rank])
        except Exception as exc:  # noqa: BLE001 - the outcome per rank is what the tests compare
            return exc

    return world.run(one_rank)


def _same_error_everywhere(outcomes, kind, pattern):
    assert all(type(o) is kind for o in outcomes), outcomes
    messages = {str(o) for o in outcomes}
    assert len(messages) == 1, messages
    assert re.search(pattern, messages.pop())


def _still_in_step(world, adapters):
    shares = [make_share(r, world.size, NUM_TILES, shape=SHAPE) for r in range(world.size)]
    for tiles in gather_on_every_rank(world, adapters, NUM_TILES, shape=SHAPE):
        assert_tiles_equal(tiles, oracle_gather(shares, NUM_TILES))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_bad_input_on_one_rank_raises_the_same_error_on_every_rank(case):
    world = ThreadWorld(WORLD)
    adapters = ranks_with_gather(world)
    outcomes = _gather_each(world, adapters, [inputs_for(case, r) for r in range(WORLD)])
    _same_error_everywhere(outcomes, {"ValueError": ValueError, "RuntimeError": RuntimeError}[case.kind], case.pattern)
    _still_in_step(world, adapters)


def test_a_local_failure_is_the_cause_of_the_error_on_its_own_rank_only():
    world = ThreadWorld(WORLD)
    adapters = ranks_with_gather(world)
    (case,) = [c for c in CASES if c.id == "copy-in-raises"]
    outcomes = _gather_each(world, adapters, [inputs_for(case, r) for r in range(WORLD)])
    causes = [str(o.__cause__) if o.__cause__ else None for o in outcomes]
    assert causes == [None, None, "injected: the copy-in failed", None]


def test_no_memory_on_one_rank_raises_out_of_memory_on_every_rank_and_the_gather_allocates_nothing_else(monkeypatch):
    world = ThreadWorld(WORLD)
    adapters = ranks_with_gather(world)  # the header buffers are allocated here, at install
    real, asked = collective_workspaces.allocate_bytes, []

    def rank_2_has_no_memory(nbytes, device, group):
        asked.append((group.rank(), nbytes))
        if group.rank() == 2 and rank_2_has_no_memory.armed:
            raise torch.OutOfMemoryError("injected: out of device memory")
        return real(nbytes, device, group)

    rank_2_has_no_memory.armed = True
    monkeypatch.setattr(collective_workspaces, "allocate_bytes", rank_2_has_no_memory)  # the workspace's
    good = [(make_share(r, WORLD, NUM_TILES, shape=SHAPE), NUM_TILES) for r in range(WORLD)]
    outcomes = _gather_each(world, adapters, good)
    # 9 tiles over 4 ranks: slots of 3 tiles of 384 bytes.
    _same_error_everywhere(
        outcomes,
        torch.OutOfMemoryError,
        r"rank\(s\) \[2\] could not allocate the 4608 bytes .*VLLM_OMNI_H3_VAE_GATHER_REUSE=0",
    )
    assert sorted(asked) == [(0, 4608), (1, 4608), (2, 4608), (3, 4608)]  # the workspace, nothing else
    assert all(a.model.own_gather_calls == 0 for a in adapters)  # no fallback to a gather that needs more memory
    rank_2_has_no_memory.armed = False
    _still_in_step(world, adapters)  # the next request allocates and succeeds


def test_no_memory_for_the_header_buffer_fails_the_install_before_any_collective(monkeypatch):
    def no_memory(nbytes, device, group):
        raise torch.OutOfMemoryError(f"injected: {nbytes} bytes")

    monkeypatch.setattr(collective_workspaces, "allocate_bytes", no_memory)
    adapter = StandInAdapter()
    with pytest.raises(torch.OutOfMemoryError, match="injected: 28672 bytes"):
        install_tile_gather_reuse(adapter, enabled=True)
    assert get_tile_gather(adapter) is None


def test_removing_and_reinstalling_on_one_rank_only_keeps_every_rank_in_step():
    world = ThreadWorld(WORLD)
    adapters = ranks_with_gather(world)
    _still_in_step(world, adapters)
    vae_gather.remove_tile_gather_reuse(adapters[1])
    assert install_tile_gather_reuse(adapters[1], enabled=True)
    _still_in_step(world, adapters)
    assert get_tile_gather(adapters[1]).stats()["allocs"] == 1 and get_tile_gather(adapters[0]).stats()["hits"] == 1


def test_non_contiguous_tiles_gather_bit_for_bit():
    world = ThreadWorld(WORLD)
    adapters = ranks_with_gather(world)
    shares = [[t.transpose(-1, -2) for t in make_share(r, WORLD, 9)] for r in range(WORLD)]
    assert not shares[0][0].is_contiguous()
    for tiles in _gather_each(world, adapters, [(s, 9) for s in shares]):
        assert_tiles_equal(tiles, oracle_gather(shares, 9))


def test_zero_element_tiles_come_back_empty():
    world = ThreadWorld(WORLD)
    adapters = ranks_with_gather(world)
    shares = [make_share(r, WORLD, 6, shape=(3, 0, 4, 4)) for r in range(WORLD)]
    for tiles in _gather_each(world, adapters, [(s, 6) for s in shares]):
        assert_tiles_equal(tiles, oracle_gather(shares, 6))


def test_tiles_that_require_grad_on_one_rank_gather_like_the_others():
    world = ThreadWorld(WORLD)
    adapters = ranks_with_gather(world)
    shares = [make_share(r, WORLD, 9) for r in range(WORLD)]
    shares[3] = [t.clone().requires_grad_() for t in shares[3]]
    for tiles in _gather_each(world, adapters, [(s, 9) for s in shares]):
        assert_tiles_equal(tiles, [t.detach() for t in oracle_gather(shares, 9)])


def test_tiles_on_another_device_than_the_workspace_move_it_there():
    world = ThreadWorld(2)
    adapters = ranks_with_gather(world)
    for adapter in adapters:  # a workspace on another device ("meta" stands in for another card)
        get_tile_gather(adapter).workspace.ensure(4096, torch.device("meta"), None)
    shares = [make_share(r, 2, 4, shape=SHAPE) for r in range(2)]
    for tiles in gather_on_every_rank(world, adapters, 4, shape=SHAPE):
        assert_tiles_equal(tiles, oracle_gather(shares, 4))
    assert all(get_tile_gather(a).workspace.block.device.type == "cpu" for a in adapters)
    assert all(get_tile_gather(a).stats()["allocs"] == 2 for a in adapters)


def test_single_rank_with_a_wrong_share_raises():
    adapter = StandInAdapter()
    install_tile_gather_reuse(adapter, enabled=True)
    with pytest.raises(ValueError, match=r"rank 0 holds 2 tile\(s\); round-robin ownership of 3 tiles"):
        adapter.model._all_gather_tiled_results(make_share(0, 1, 2), 3)


@pytest.mark.parametrize(
    "state",
    [
        {},
        None,
        {"sp_size": 4, "sp_rank": 0},
        {"sp_size": "1", "sp_rank": 0, "sp_process_group": None},
        {"sp_size": True, "sp_rank": 0, "sp_process_group": None},
        {"sp_size": 4, "sp_rank": 1, "sp_process_group": None},
    ],
    ids=["empty", "none", "no-group-key", "size-str", "size-bool", "group-none"],
)
def test_a_parallel_state_without_a_group_that_is_not_one_rank_is_a_clear_error_naming_it(state):
    adapter = StandInAdapter()
    adapter.state = state
    install_tile_gather_reuse(adapter, enabled=True)
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[0\] failed before the exchange") as raised:
        adapter.model._all_gather_tiled_results([make_tile(0)], 4)
    assert re.search(
        re.escape(f"parallel state {state!r}; expected sp_size=1 and sp_rank=0"), str(raised.value.__cause__)
    )


@pytest.mark.parametrize(
    "wrong",
    [{"sp_size": 2}, {"sp_rank": 3}, {"sp_rank": "2"}, {"sp_size": None}],
    ids=["size", "rank", "rank-str", "size-none"],
)
def test_a_wrong_parallel_state_on_one_rank_raises_the_same_error_on_every_rank_and_names_it_there(wrong):
    world = ThreadWorld(WORLD)
    adapters = ranks_with_gather(world)
    good = dict(adapters[2].state)
    adapters[2].state = {**good, **wrong}
    shares = [(make_share(r, WORLD, NUM_TILES, shape=SHAPE), NUM_TILES) for r in range(WORLD)]
    outcomes = _gather_each(world, adapters, shares)
    _same_error_everywhere(outcomes, RuntimeError, r"rank\(s\) \[2\] failed before the exchange")
    assert "parallel state" in str(outcomes[2].__cause__) and "expected sp_size=4 and sp_rank=2" in str(
        outcomes[2].__cause__
    )
    assert all(o.__cause__ is None for r, o in enumerate(outcomes) if r != 2)
    adapters[2].state = good
    _still_in_step(world, adapters)


class _Unreadable(dict):
    def get(self, *args):
        raise RuntimeError("injected: the checkpoint's parallel state cannot be read")


@pytest.mark.parametrize(
    "state",
    [_Unreadable(), None, {"sp_size": WORLD, "sp_rank": 1}, {"sp_size": WORLD, "sp_rank": 1, "sp_process_group": None}],
    ids=["unreadable", "none", "no-group-key", "group-none"],
)
def test_a_rank_whose_state_names_no_group_tells_its_peers_over_its_last_gathers_group(state):
    world = ThreadWorld(WORLD)
    adapters = ranks_with_gather(world)
    _still_in_step(world, adapters)  # a first gather: every rank has gathered over its group
    good, adapters[1].state = adapters[1].state, state
    shares = [(make_share(r, WORLD, NUM_TILES, shape=SHAPE), NUM_TILES) for r in range(WORLD)]
    outcomes = _gather_each(world, adapters, shares)
    _same_error_everywhere(outcomes, RuntimeError, r"rank\(s\) \[1\] failed before the exchange")
    assert "injected" in str(outcomes[1].__cause__) or "parallel state" in str(outcomes[1].__cause__)
    adapters[1].state = good
    _still_in_step(world, adapters)


@pytest.mark.parametrize(
    "adapter,pattern",
    [
        (object(), r"object \(.model: NoneType\); expected a MiniMaxH3VideoVAE"),
        (type("Adapter", (), {"model": torch.nn.Linear(1, 1)})(), r"Adapter \(.model: Linear\)"),
        (type("NoState", (), {"model": StandInAdapter().model})(), r"NoState .*with _native_parallel_state"),
    ],
    ids=["no-model", "model-without-the-gather", "no-parallel-state"],
)
def test_install_on_something_that_is_not_the_adapter_is_a_clear_error(adapter, pattern):
    with pytest.raises(TypeError, match=pattern):
        install_tile_gather_reuse(adapter, enabled=True)
