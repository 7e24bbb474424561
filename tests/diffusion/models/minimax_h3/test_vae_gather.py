# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The address-stable tile gather in one process: ranks are threads, the collective is a recorder."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

from vllm_omni.diffusion.models.minimax_h3 import vae_gather
from vllm_omni.diffusion.models.minimax_h3.vae_gather import (
    REUSE_ENV,
    get_tile_gather,
    install_tile_gather_reuse,
    remove_tile_gather_reuse,
)
from vllm_omni.distributed import collective_workspaces

from .fake_collective import ThreadWorld
from .stand_ins import (
    StandInAdapter,
    StandInCheckpoint,
    assert_tiles_equal,
    gather_on_every_rank,
    make_share,
    oracle_gather,
    ranks_with_gather,
)

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion]


CASES = [(n, w) for n in (5, 8, 9, 28) for w in (2, 3, 4) if n >= w]


@pytest.mark.parametrize("num_tiles,sp_size", CASES)
def test_tiles_equal_the_contract_oracle_bit_for_bit_in_global_order(fake_collective, num_tiles, sp_size):
    world = ThreadWorld(sp_size)
    adapters = ranks_with_gather(world)
    shares = [make_share(r, sp_size, num_tiles) for r in range(sp_size)]
    expected = oracle_gather(shares, num_tiles)

    for tiles in gather_on_every_rank(world, adapters, num_tiles):
        assert_tiles_equal(tiles, expected)


def test_bfloat16_tiles_round_trip_bit_for_bit(fake_collective):
    world = ThreadWorld(4)
    adapters = ranks_with_gather(world)
    shares = [make_share(r, 4, 9, dtype=torch.bfloat16) for r in range(4)]
    for tiles in gather_on_every_rank(world, adapters, 9, dtype=torch.bfloat16):
        assert_tiles_equal(tiles, oracle_gather(shares, 9))


def test_send_and_receive_stay_in_one_allocation_across_calls_and_smaller_geometries(fake_collective):
    world = ThreadWorld(4)
    adapters = ranks_with_gather(world)
    for num_tiles in (28, 28, 9, 28, 5, 28):
        gather_on_every_rank(world, adapters, num_tiles)

    for rank in range(4):
        calls = [c for c in world.calls if c.rank == rank]
        gather = get_tile_gather(adapters[rank])
        assert all(c.send_alloc == c.recv_alloc for c in calls)  # in place: send lies inside receive
        # Two allocations for the life of the adapter: the workspace (sized by the first, largest call) and the
        # headers' buffer; no call hands the collective anything else.
        assert {c.recv_alloc for c in calls} == {gather.workspace.data_ptr, gather._headers.data_ptr()}
        assert gather.stats()["allocs"] == 1


def test_workspace_grows_only_when_a_larger_geometry_arrives(fake_collective):
    world = ThreadWorld(4)
    adapters = ranks_with_gather(world)
    gather = get_tile_gather(adapters[0])
    sizes = []
    for num_tiles in (8, 8, 5, 28, 9, 28, 8):
        gather_on_every_rank(world, adapters, num_tiles)
        sizes.append((gather.stats()["allocs"], gather.workspace.nbytes))

    # A (3, 2, 4, 4) float32 tile is 384 bytes; 4 slots of ceil(n / 4) tiles, each slot a multiple of 128 bytes.
    small, large = 4 * 2 * 384, 4 * 7 * 384
    assert sizes == [(1, small), (1, small), (1, small), (2, large), (2, large), (2, large), (2, large)]
    stats = gather.stats()
    assert stats["hits"] == 5 and stats["allocs"] == 2
    assert stats["geometries"]["sp4/28x(3, 2, 4, 4)/torch.float32"] == 2


def test_mixed_dtypes_share_one_workspace(fake_collective):
    world = ThreadWorld(2)
    adapters = ranks_with_gather(world)
    gather_on_every_rank(world, adapters, 8, dtype=torch.float32)
    gather_on_every_rank(world, adapters, 8, dtype=torch.bfloat16)
    gather_on_every_rank(world, adapters, 8, dtype=torch.float16)
    gather = get_tile_gather(adapters[1])
    assert gather.stats()["allocs"] == 1 and gather.stats()["hits"] == 2
    assert {c.recv_alloc for c in world.calls if c.rank == 1} == {gather.workspace.data_ptr, gather._headers.data_ptr()}


@pytest.mark.parametrize("num_tiles,sp_size", [(8, 4), (4, 4), (9, 4)])
def test_returned_tiles_never_alias_the_workspace_and_survive_the_next_gather(fake_collective, num_tiles, sp_size):
    world = ThreadWorld(sp_size)
    adapters = ranks_with_gather(world)
    first = gather_on_every_rank(world, adapters, num_tiles)
    kept = [[t.clone() for t in tiles] for tiles in first]
    gather_on_every_rank(world, adapters, num_tiles, salt=1)  # same geometry, other values
    for rank, tiles in enumerate(first):
        workspace = get_tile_gather(adapters[rank]).workspace.data_ptr
        assert all(t.untyped_storage().data_ptr() != workspace for t in tiles)
        assert all(torch.equal(t, k) for t, k in zip(tiles, kept[rank], strict=True))


def test_single_rank_returns_copies_of_its_tiles_and_makes_no_collective(monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("a single rank must not call a collective")

    monkeypatch.setattr(vae_gather.dist, "all_gather_single", no_collective)
    adapter = StandInAdapter()
    install_tile_gather_reuse(adapter, enabled=True)
    tasks = make_share(0, 1, 3)
    tiles = adapter.model._all_gather_tiled_results(tasks, 3)
    assert_tiles_equal(tiles, tasks)
    assert all(t.data_ptr() != s.data_ptr() for t, s in zip(tiles, tasks, strict=True))


def test_backend_that_allocates_registered_memory_provides_the_workspace(monkeypatch):
    # A stand-in backend (no XCCL here) that says it can hand out memory it registers once.
    handed_out = []

    class Backend:
        def supports_tensor_alloc(self, device):
            return device.type == "cpu"

        def allocate_tensor(self, numel, *, dtype, device):
            handed_out.append(torch.empty(numel, dtype=dtype, device=device))
            return handed_out[-1]

    class Group:
        def _get_backend(self, device):
            return Backend()

    block = collective_workspaces.allocate_bytes(4096, torch.device("cpu"), Group())
    assert block.data_ptr() == handed_out[0].data_ptr() and block.dtype == torch.uint8 and block.numel() == 4096
    plain = collective_workspaces.allocate_bytes(4096, torch.device("cpu"), None)
    assert plain.data_ptr() != handed_out[0].data_ptr() and len(handed_out) == 1


# Gating


@pytest.mark.parametrize(
    "env,device,installed",
    [
        (None, "xpu", True),
        (None, "cpu", False),
        ("auto", "xpu", True),
        ("auto", "cuda", False),
        ("1", "cpu", True),
        (" 1 ", "cuda", True),
        ("0", "xpu", False),
    ],
)
def test_env_mode_decides_where_the_override_is_installed(monkeypatch, device_stand_in, env, device, installed):
    if env is None:
        monkeypatch.delenv(REUSE_ENV, raising=False)
    else:
        monkeypatch.setenv(REUSE_ENV, env)
    adapter = StandInAdapter(device)
    assert install_tile_gather_reuse(adapter) is installed
    assert (get_tile_gather(adapter) is not None) is installed
    if not installed:  # the checkpoint's method is left untouched
        assert "_all_gather_tiled_results" not in vars(adapter.model)


def _adapter_built_by_its_own_init(monkeypatch, checkpoint, device):
    """``MiniMaxH3VideoVAE.__init__`` as it runs, with the component's loading stubbed out (no checkpoint here)."""
    from vllm_omni.diffusion.models.minimax_h3 import vae as vae_module

    remote = torch.nn.Module()
    remote.model = checkpoint
    config = {"latent_channels": 1, "latents_mean": [0.0], "latents_std": [1.0]}
    monkeypatch.setattr(vae_module, "_load_component_config", lambda path: config)
    monkeypatch.setattr(vae_module, "_load_remote_component", lambda path, config, **kwargs: remote)
    monkeypatch.setattr(torch, "get_device_module", lambda *args, **kwargs: None)  # CPU torch: no device module
    return vae_module.MiniMaxH3VideoVAE("unused", device=torch.device(device))


@pytest.mark.parametrize(
    "env,device,installed", [("1", "cpu", True), ("auto", "cpu", False), ("auto", "meta", False), ("0", "cpu", False)]
)
def test_the_adapters_own_init_installs_the_gather_as_the_switch_says(monkeypatch, env, device, installed):
    monkeypatch.setenv(REUSE_ENV, env)
    checkpoint = StandInCheckpoint()
    adapter = _adapter_built_by_its_own_init(monkeypatch, checkpoint, device)
    assert adapter.model is checkpoint and (get_tile_gather(adapter) is not None) is installed
    if not installed:  # off XPU, the checkpoint's own method, untouched
        assert "_all_gather_tiled_results" not in vars(checkpoint)


@pytest.mark.parametrize("value", [None, "auto", " 1 ", "0"])
def test_the_diffusion_envs_declare_the_switch_the_gather_reads(monkeypatch, value):
    from vllm_omni.diffusion import envs

    monkeypatch.delenv(REUSE_ENV, raising=False) if value is None else monkeypatch.setenv(REUSE_ENV, value)
    assert ("auto" if value is None else value) == envs.VLLM_OMNI_H3_VAE_GATHER_REUSE  # raw, as upstream's envs are
    assert vae_gather.reuse_mode() == ("auto" if value is None else value.strip())


@pytest.mark.parametrize("value", ["", "yes", "true", "2", "on", "xpu"])
def test_bad_env_value_raises_naming_the_value(monkeypatch, device_stand_in, value):
    monkeypatch.setenv(REUSE_ENV, value)
    with pytest.raises(ValueError, match=f"{REUSE_ENV}={value!r}.*'auto', '1' or '0'"):
        install_tile_gather_reuse(StandInAdapter("xpu"))


def test_explicit_enabled_overrides_the_env(monkeypatch):
    monkeypatch.setenv(REUSE_ENV, "0")
    assert install_tile_gather_reuse(StandInAdapter("cpu"), enabled=True)
    monkeypatch.setenv(REUSE_ENV, "1")
    assert not install_tile_gather_reuse(StandInAdapter("cpu"), enabled=False)


def test_install_is_idempotent_and_binds_on_the_instance_only():
    class_method = StandInCheckpoint.__dict__["_all_gather_tiled_results"]
    adapter, other = StandInAdapter(), StandInAdapter()
    assert install_tile_gather_reuse(adapter, enabled=True)
    gather = get_tile_gather(adapter)
    assert install_tile_gather_reuse(adapter, enabled=True)
    assert get_tile_gather(adapter) is gather and adapter.model._all_gather_tiled_results is gather
    assert StandInCheckpoint.__dict__["_all_gather_tiled_results"] is class_method
    assert other.model._all_gather_tiled_results.__func__ is class_method


@pytest.mark.parametrize("env,device", [(None, "xpu"), ("1", "cpu"), ("1", "cuda")])
def test_a_checkpoint_without_the_gather_is_logged_and_left_alone_under_the_env_switch(
    monkeypatch, device_stand_in, gather_log, env, device
):
    monkeypatch.delenv(REUSE_ENV, raising=False) if env is None else monkeypatch.setenv(REUSE_ENV, env)
    adapter = StandInAdapter(device)
    adapter.model = torch.nn.Linear(1, 1)  # a VAE checkpoint of another make: no _all_gather_tiled_results
    assert not install_tile_gather_reuse(adapter)
    assert get_tile_gather(adapter) is None and device_stand_in == []  # nothing allocated
    (warning,) = gather_log.messages(logging.WARNING)
    assert "not installed, the checkpoint's gather stays: StandInAdapter (.model: Linear)" in warning


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_auto_mode_off_xpu_decides_before_looking_at_the_checkpoint(monkeypatch, gather_log, device):
    monkeypatch.setenv(REUSE_ENV, "auto")
    adapter = StandInAdapter(device)
    adapter.model = None  # would be a TypeError if it were looked at
    assert not install_tile_gather_reuse(adapter)
    assert gather_log.records == []


def test_the_header_buffer_is_allocated_at_install_on_the_adapters_device(device_stand_in):
    adapter = StandInAdapter("xpu")
    assert install_tile_gather_reuse(adapter, enabled=True)
    # One row of 14 int64 words for each of up to 256 ranks, on xpu:0 (the stand-in's current card).
    assert device_stand_in == [torch.device("xpu", 0)]
    assert get_tile_gather(adapter)._headers.nbytes == 256 * 14 * 8


def test_the_gather_holds_its_adapter_weakly_so_del_frees_the_workspace_without_a_collection(fake_collective):
    world = ThreadWorld(2)
    adapters = ranks_with_gather(world)
    gather_on_every_rank(world, adapters, 4)
    gather = get_tile_gather(adapters[0])
    adapter_ref, block_ref = weakref.ref(adapters[0]), weakref.ref(gather.workspace.block)
    del gather
    gc.disable()
    try:
        adapters[0] = None
        assert adapter_ref() is None and block_ref() is None
    finally:
        gc.enable()


def test_a_gather_whose_adapter_is_gone_raises_naming_the_missing_state():
    adapter = StandInAdapter()
    install_tile_gather_reuse(adapter, enabled=True)
    gather = get_tile_gather(adapter)
    del adapter
    with pytest.raises(RuntimeError, match=r"failed before the exchange") as raised:
        gather([make_share(0, 1, 1)[0]], 1)
    assert "parallel state None; expected sp_size=1" in str(raised.value.__cause__)


def test_resolve_device_names_the_current_card_when_the_index_is_left_out(monkeypatch):
    monkeypatch.setattr(torch.xpu, "current_device", lambda: 3)  # stand-in: no XPU here
    assert vae_gather.resolve_device("xpu") == torch.device("xpu", 3)
    assert vae_gather.resolve_device("xpu:1") == torch.device("xpu", 1)
    assert vae_gather.resolve_device("cpu") == torch.device("cpu")


def test_growth_waits_for_the_device_before_the_old_block_is_freed(monkeypatch):
    events = []
    from vllm_omni.distributed import collective_workspaces

    monkeypatch.setattr(collective_workspaces, "synchronize", lambda device: events.append(f"synchronize {device}"))
    workspace = collective_workspaces.GrowOnlyBlock()
    workspace.ensure(128, torch.device("cpu"), None)
    weakref.finalize(workspace.block, events.append, "old block freed")
    assert not workspace.ensure(64, torch.device("cpu"), None) and events == []
    assert workspace.ensure(256, torch.device("cpu"), None)
    assert events == ["synchronize cpu", "old block freed"]


def test_removal_restores_the_checkpoint_method_exactly_and_drops_the_workspace(fake_collective):
    world = ThreadWorld(2)
    adapters = ranks_with_gather(world)
    gather_on_every_rank(world, adapters, 4)
    gather = get_tile_gather(adapters[0])
    assert gather.workspace.nbytes > 0

    assert remove_tile_gather_reuse(adapters[0])
    assert gather.workspace.nbytes == 0
    method = adapters[0].model._all_gather_tiled_results
    assert method.__func__ is StandInCheckpoint._all_gather_tiled_results and method.__self__ is adapters[0].model
    assert "_all_gather_tiled_results" not in vars(adapters[0].model)
    assert not remove_tile_gather_reuse(adapters[0])


def test_an_existing_instance_override_is_replaced_and_removal_restores_the_class_method():
    adapter = StandInAdapter()
    adapter.model._all_gather_tiled_results = lambda tasks, num_tiles: "upstream override"
    assert install_tile_gather_reuse(adapter, enabled=True)
    assert adapter.model._all_gather_tiled_results is get_tile_gather(adapter)
    remove_tile_gather_reuse(adapter)
    assert adapter.model._all_gather_tiled_results([], 1) == ["checkpoint gather"]


# Receipts


def test_install_logs_one_info_line_with_device_and_mode(gather_log, monkeypatch, device_stand_in):
    monkeypatch.setenv(REUSE_ENV, "auto")
    install_tile_gather_reuse(StandInAdapter("xpu"))
    install_tile_gather_reuse(StandInAdapter("cpu"), enabled=True)
    infos = gather_log.messages(logging.INFO)
    assert len(infos) == 2
    assert "device=xpu mode=auto" in infos[0] and "device=cpu mode=forced" in infos[1]


def test_each_gather_logs_one_debug_line_with_its_quantities(fake_collective, gather_log):
    world = ThreadWorld(2)
    adapters = ranks_with_gather(world)
    for num_tiles in (4, 4, 8):
        gather_on_every_rank(world, adapters, num_tiles)
    lines = gather_log.messages(logging.DEBUG)  # two ranks per call, calls in sequence
    assert [line.split()[1] for line in lines] == ["reuse=alloc"] * 2 + ["reuse=hit"] * 2 + ["reuse=alloc"] * 2
    need = 2 * 4 * 384  # two slots of four 384-byte tiles
    assert all(f"geometry=sp2/8x(3, 2, 4, 4)/torch.float32 workspace_bytes={need} " in line for line in lines[4:])
    assert all(line.endswith("hits=1 allocs=1") for line in lines[2:4])
    assert all(line.endswith("hits=1 allocs=2") for line in lines[4:])
    workspaces = {f"workspace_ptr=0x{get_tile_gather(a).workspace.data_ptr:x}" for a in adapters}
    assert {next(w for w in workspaces if w in line) for line in lines[4:]} == workspaces
