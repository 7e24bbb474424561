# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The census of the synthetic Wan2.2 text-to-video checkpoint (two experts), served on four CPU ranks with the
whole-request fix staged, in the request pool, and as released (what the plugin runs at ``0``), DiT compiled, in each
layout vLLM-Omni offers for it. CI runs the VAE's spatially sharded decode over Ulysses 4 on vLLM-Omni 0.28.0 (the
all-to-alls run inside the compiled blocks, the VAE exchanges halos); Ulysses with tile-parallel VAE, Ring, TP and
CFG parallel run with ``--full-census`` (Ring's compiled exchange is also
``tests/distributed/test_sequence_parallel.py``'s). Pipeline parallelism is ``test_pipeline_census_layouts.py``'s. On
0.30.0 CI serves Wan2.2 end to end (``tests/e2e/test_wan2_2_serve_cpu.py``), with the plugin and in the patched tree."""

from __future__ import annotations

import json

import pytest

from benchmarks import pipeline_census as census_bench
from benchmarks.pipeline_census import requests_of
from tooling import serve_cpu
from xpu_collective_memory.census import COMPONENTS

pytestmark = [
    pytest.mark.advanced_model,
    pytest.mark.cpu,
    pytest.mark.diffusion,
    pytest.mark.parallel,
]

REQUESTS = 2  # request 1 holds the warm-up and the first allocations; request 2 is the steady state
# Each layout and what marks the DiT call site that only it has: its collective, or its file.
LAYOUTS = {
    "ulysses": "all_to_all_single @ ",
    "ring": "batch_isend_irecv @ ",
    "tp": "all_reduce @ ",
    "cfg": "(cfg_parallel.py:",
    "spatial_shard": "all_to_all_single @ ",
}
CI_LAYOUTS = ("spatial_shard",)
# The VAE's parallel decode: vLLM-Omni's tile executor, or the spatial shard's halo exchange.
VAE_FILES = {"spatial_shard": "wan_spatial_shard.py"}


@pytest.fixture(
    scope="module",
    params=[
        layout if layout in CI_LAYOUTS else pytest.param(layout, marks=pytest.mark.full_census) for layout in LAYOUTS
    ],
)
def census(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"census-{request.param}")
    cache = tmp_path_factory.getbasetemp() / "wan2_2"
    argv = ["--pipeline", "wan2_2", "--layout", request.param, "--requests", str(REQUESTS), "--output-dir", str(out)]
    code = census_bench.main([*argv, "--cache-dir", str(cache)])
    return request.param, code, json.loads((out / "census.json").read_text()), out


def test_exits_zero_with_the_media_staged_and_in_the_pool_identical_to_the_releases(census):
    _, code, summary, _ = census
    assert code == 0 and summary["media_identical"] and list(summary["runs"]) == ["whole", "pool", "release"]
    assert summary["media_groups"] == [["whole"], ["pool", "release"]]  # Inductor fuses around the ops otherwise
    assert all(d["psnr_db"] >= 35 for d in summary["media_difference"]["whole"]), summary["media_difference"]
    assert summary["config"]["pipeline"] == "wan2_2" and summary["projection"] is None
    assert len(set(summary["runs"]["whole"]["media_sha256"])) == 1  # identical requests, identical media


def test_with_the_fix_no_component_hands_the_backend_a_fresh_buffer_after_request_1(census):
    _, _, summary, _ = census
    for rank, index, request in requests_of(summary, "whole"):
        for component, totals in census_bench.by_component(request).items():
            if index > 0:
                assert totals["fresh_buffers"] == 0 and totals["fresh_bytes"] == 0, (rank, index, component)
    for rank, _, request in requests_of(summary, "release"):  # without it, the DiT and the VAE do every request
        totals = census_bench.by_component(request)
        assert totals["dit"]["fresh_buffers"] > 0 and totals["video_vae"]["fresh_buffers"] > 0, rank


def test_with_the_fix_no_request_has_an_unmanaged_site_and_without_it_the_dit_and_vae_have(census):
    layout, _, summary, _ = census
    assert summary["unmanaged_sites"]["whole"] == {}
    sites = summary["unmanaged_sites"]["release"]
    assert any(LAYOUTS[layout] in site for site in sites), sites
    assert any(VAE_FILES.get(layout, "distributed_vae_executor.py") in site for site in sites), sites


def test_the_layouts_collectives_are_the_dits_and_the_vae_tiles_are_gathered_on_every_rank(census):
    layout, _, summary, _ = census
    for fix in ("release", "whole"):
        for rank, index, request in requests_of(summary, fix):
            sites = list(request["books"]["dit"])
            assert any(LAYOUTS[layout] in site for site in sites), (fix, rank, index, sites)
            assert census_bench.by_component(request)["video_vae"]["calls"] > 0
            assert set(request["books"]) <= set(COMPONENTS) and request["bookkeeping_errors"] == 0


def test_both_experts_run_every_request_with_the_offloads_release_between_them(census):
    _, _, summary, _ = census
    for fix in ("release", "whole"):
        for _, index, request in requests_of(summary, fix):
            if index == 0:  # request 1 also holds the engine's warm-up
                continue
            steps = [step for step in request["timeline"] if step != "other"]
            order = [step for i, step in enumerate(steps) if i == 0 or steps[i - 1] != step]
            assert order == ["release", "dit", "release", "dit", "release", "video_vae"], request["timeline"]


def test_the_persistent_collectives_stop_allocating_after_request_1_and_never_fall_back(census):
    _, _, summary, _ = census
    for rank in summary["runs"]["whole"]["ranks"]:
        rows = census_bench.layer_per_request(rank)
        assert len(rows) == REQUESTS and rows[0]["block_allocations"] > 0
        assert [r["block_allocations"] for r in rows[1:]] == [0] * (REQUESTS - 1)
        assert all(r["fallbacks"] == 0 and r["staged_calls"] > 0 for r in rows)
    assert all(census_bench.layer_per_request(r) == [] for r in summary["runs"]["release"]["ranks"])


def test_every_run_compiles_both_experts_and_only_staging_changes_the_releases_graph_breaks(census):
    _, _, summary, _ = census
    for fix in ("whole", "pool", "release"):
        for rank in summary["runs"][fix]["ranks"]:
            assert [c["dit_compiled"] for c in rank["compile"]] == [True] * REQUESTS, (fix, rank["rank"])
    breaks = {fix: [r["graph_breaks"] for r in ranks] for fix, ranks in summary["compile"].items()}
    assert breaks["pool"] == breaks["release"], breaks  # the pool routes no collective
    assert all(staged <= released for staged, released in zip(breaks["whole"], breaks["release"], strict=True))


def test_in_pool_mode_every_forward_runs_in_the_pool_nothing_is_staged_and_no_address_outside_it_is_new(census):
    # The CPU test platform's stand-in for the pool API: it proves where the pool is used, not where memory lands.
    _, _, summary, _ = census
    for rank in summary["runs"]["pool"]["ranks"]:
        assert [p["in_pool"] for p in rank["pool"]] == [True] * REQUESTS, rank["rank"]
        for row in census_bench.layer_per_request(rank):
            assert row["staged_calls"] == row["blocks"] == row["staged_bytes"] == 0, rank["rank"]
        later = rank["requests"][1:]
        assert all(request["outside_pool_fresh"] == {} for request in later), rank["rank"]


def test_every_worker_and_only_the_workers_use_persistent_buffers_with_the_fix_and_compile_both_experts(census):
    layout, _, _, out = census
    for fix in ("release", "whole"):
        log = (out / f"{layout}-{fix}" / "server.log").read_text(errors="replace")
        layer = serve_cpu.receipt_pids(log, "layer_installs")
        compiling = serve_cpu.receipt_pids(log, "dit_compile")
        assert len(compiling) == serve_cpu.WORLD and set(compiling.values()) == {2}, (fix, compiling)
        assert layer == ({pid: 1 for pid in compiling} if fix == "whole" else {}), (fix, layer)
        assert "Traceback" not in log
