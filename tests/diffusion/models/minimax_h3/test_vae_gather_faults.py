# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Bad input and injected faults on four real gloo ranks: whatever one rank gets wrong, no peer is left blocked.

One start of ranks runs the shared case table (bad_input_cases.py), an out-of-memory on one rank and a reinstall on
one rank; after each case a good gather proves the ranks are still in step. A rank left inside a collective
would show as a timeout well under the group's.
"""

from __future__ import annotations

import re

import pytest

from tests.utils import results_or_raise, run_ranks

from .bad_input_cases import CASES, WORLD

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.parallel]

PG_TIMEOUT_S = 30


def _cases_on_one_rank(rank: int, world: int) -> dict:
    import time

    import torch

    from tests.diffusion.models.minimax_h3.bad_input_cases import BAD_RANK, NUM_TILES, SHAPE, inputs_for
    from tests.diffusion.models.minimax_h3.gloo_checkpoint import checkpoint_on_gloo_rank
    from tests.diffusion.models.minimax_h3.stand_ins import make_share, make_tile
    from vllm_omni.diffusion.models.minimax_h3 import vae_gather
    from vllm_omni.distributed import collective_workspaces

    adapter = checkpoint_on_gloo_rank(rank, world)
    vae_gather.install_tile_gather_reuse(adapter, enabled=True)

    def gather(*inputs):
        return adapter.model._all_gather_tiled_results(*inputs)

    def in_step() -> bool:
        tiles = gather(make_share(rank, world, NUM_TILES, shape=SHAPE), NUM_TILES)
        return all(torch.equal(t, make_tile(g, shape=SHAPE)) for g, t in enumerate(tiles))

    outcomes: dict = {}
    causes: dict = {}

    def record(case_id: str, run) -> None:
        start = time.monotonic()
        try:
            run()
            outcome = ("ok", "")
        except Exception as exc:  # noqa: BLE001 - compared across ranks by the test
            outcome = (type(exc).__name__, str(exc))
            causes[case_id] = None if exc.__cause__ is None else str(exc.__cause__)
        outcomes[case_id] = (*outcome, in_step(), time.monotonic() - start)

    for case in CASES:
        record(case.id, lambda case=case: gather(*inputs_for(case, rank)))

    # Out of memory on one rank: no allocation at all succeeds there while the next geometry needs a larger
    # workspace. Every allocation a gather asks for is recorded: the header buffer was made at install.
    real_allocate, asked = collective_workspaces.allocate_bytes, []

    def out_of_memory(nbytes, device, group):
        asked.append(nbytes)
        if rank == BAD_RANK:
            raise torch.OutOfMemoryError("injected: out of device memory")
        return real_allocate(nbytes, device, group)

    def grow_without_memory() -> None:
        collective_workspaces.allocate_bytes = out_of_memory
        try:
            gather(make_share(rank, world, 28, shape=SHAPE), 28)
        finally:
            collective_workspaces.allocate_bytes = real_allocate

    record("out-of-memory", grow_without_memory)

    # Remove and reinstall on one rank only: its new workspace must not disturb the others.
    if rank == 1:
        vae_gather.remove_tile_gather_reuse(adapter)
        vae_gather.install_tile_gather_reuse(adapter, enabled=True)
    record("reinstall-on-one-rank", lambda: None)
    allocs = vae_gather.get_tile_gather(adapter).stats()["allocs"]

    # No memory for the header buffer on one rank: its install fails there, before any collective exists. Once
    # it has memory again it installs, and every rank gathers together.
    vae_gather.remove_tile_gather_reuse(adapter)
    install_error = None

    def no_memory(nbytes, device, group):
        raise torch.OutOfMemoryError(f"injected: no memory for {nbytes} bytes")

    if rank == BAD_RANK:
        collective_workspaces.allocate_bytes = no_memory
    try:
        vae_gather.install_tile_gather_reuse(adapter, enabled=True)
    except torch.OutOfMemoryError as exc:
        install_error = str(exc)
    finally:
        collective_workspaces.allocate_bytes = real_allocate
    if install_error is not None:
        vae_gather.install_tile_gather_reuse(adapter, enabled=True)
    record("header-out-of-memory-at-install", lambda: None)
    return {"outcomes": outcomes, "causes": causes, "asked": asked, "allocs": allocs, "install_error": install_error}


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    reported = run_ranks(_cases_on_one_rank, WORLD, timeout_s=360, pg_timeout_s=PG_TIMEOUT_S)
    return results_or_raise(reported, WORLD)


def _same_outcome_everywhere(reports, case_id):
    outcomes = [r["outcomes"][case_id] for r in reports]
    assert len({(kind, message) for kind, message, _, _ in outcomes}) == 1, outcomes
    assert all(in_step and seconds < PG_TIMEOUT_S / 2 for _, _, in_step, seconds in outcomes), outcomes
    return outcomes[0][:2]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_bad_input_on_one_rank_raises_the_same_error_on_every_rank_and_nobody_hangs(reports, case):
    kind, message = _same_outcome_everywhere(reports, case.id)
    assert kind == case.kind and re.search(case.pattern, message), message


def test_a_copy_in_that_fails_on_one_rank_is_the_cause_there_only(reports):
    assert [r["causes"]["copy-in-raises"] for r in reports] == [None, None, "injected: the copy-in failed", None]


def test_out_of_memory_on_one_rank_raises_on_every_rank_naming_it_and_the_off_switch(reports):
    kind, message = _same_outcome_everywhere(reports, "out-of-memory")
    assert kind == "OutOfMemoryError"
    # 28 tiles over 4 ranks: slots of 7 tiles of 384 bytes.
    assert re.search(r"rank\(s\) \[2\] could not allocate the 10752 bytes .*VLLM_OMNI_H3_VAE_GATHER_REUSE=0", message)
    assert all(r["asked"] == [10752] for r in reports)  # the workspace only: no header allocation in a gather


def test_a_reinstall_on_one_rank_leaves_every_rank_in_step(reports):
    assert _same_outcome_everywhere(reports, "reinstall-on-one-rank") == ("ok", "")
    assert reports[1]["allocs"] == 1  # the reinstalled gather started a workspace of its own


def test_no_memory_for_the_header_buffer_fails_that_ranks_install_only_and_no_gather_is_left_waiting(reports):
    assert [r["install_error"] for r in reports] == [None, None, "injected: no memory for 28672 bytes", None]
    assert _same_outcome_everywhere(reports, "header-out-of-memory-at-install") == ("ok", "")
