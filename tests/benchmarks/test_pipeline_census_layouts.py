# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The census of the parallel paths beyond MiniMax-H3's and Wan2.2's sequence layouts, each served on four CPU
ranks as released and with the whole-request fix, DiT compiled: Qwen-Image's joint attention (a synthetic
checkpoint) in Ulysses, Ring, CFG parallel and TP; Wan2.2's pipeline parallelism; MiniMax-H3 under HSDP (Wan2.2's
spatially sharded VAE is ``test_pipeline_census_wan2_2.py``'s). CI serves Qwen-Image's Ulysses on vLLM-Omni 0.28.0;
the rest run with ``--full-census`` (CI proves their parts on gloo ranks: ``tests/distributed``'s FSDP2 all-gather
and point-to-point calls, and ``vllm_omni.diffusion.distributed.hsdp`` rebound in a worker)."""

from __future__ import annotations

import json

import pytest

from benchmarks import pipeline_census as census_bench
from benchmarks.pipeline_census import requests_of
from xpu_collective_memory.census import COMPONENTS

pytestmark = [
    pytest.mark.advanced_model,
    pytest.mark.cpu,
    pytest.mark.diffusion,
    pytest.mark.parallel,
]

REQUESTS = 2  # request 1 holds the warm-up and the first allocations; request 2 is the steady state
# Each path and the file of the collective that only it makes (in the run without the fix).
PATHS = {
    ("qwen_image", "ulysses"): "all_to_all_single",  # compiled: the site is the compiled frame, not ulysses.py
    ("qwen_image", "ring"): "batch_isend_irecv",
    ("qwen_image", "cfg"): "cfg_parallel.py",
    ("qwen_image", "tp"): "all_reduce",
    ("wan2_2", "pp"): "group_coordinator.py",  # the stages' tensor dicts
    ("minimax_h3", "hsdp"): "all_gather_single @ decorate_context",  # FSDP2 unshards under its no-grad decorator
}
CI_PATHS = (("qwen_image", "ulysses"),)


@pytest.fixture(
    scope="module",
    params=[path if path in CI_PATHS else pytest.param(path, marks=pytest.mark.full_census) for path in PATHS],
    ids="-".join,
)
def census(request, tmp_path_factory):
    pipeline, layout = request.param
    out = tmp_path_factory.mktemp(f"census-{pipeline}-{layout}")
    cache = tmp_path_factory.getbasetemp() / pipeline
    argv = ["--pipeline", pipeline, "--layout", layout, "--requests", str(REQUESTS), "--output-dir", str(out)]
    code = census_bench.main([*argv, "--cache-dir", str(cache), "--without-vae-run", "--without-pool-run"])
    return request.param, code, json.loads((out / "census.json").read_text())


def test_exits_zero_with_media_the_releases_once_decoded_with_the_fix_on(census):
    (pipeline, _), code, summary = census
    assert code == 0 and summary["media_identical"] and summary["config"]["pipeline"] == pipeline
    assert len(set(summary["runs"]["whole"]["media_sha256"])) == 1
    # Inductor fuses the DiT's code around the registered ops otherwise: the release's media once decoded.
    assert all(d["psnr_db"] >= 35 for d in summary["media_difference"]["whole"]), summary["media_difference"]


def test_with_the_fix_no_rank_or_component_hands_the_backend_a_fresh_buffer_after_request_1(census):
    _, _, summary = census
    for rank, index, request in requests_of(summary, "whole"):
        assert set(request["books"]) <= set(COMPONENTS) and request["bookkeeping_errors"] == 0
        if index > 0:
            for component, totals in census_bench.by_component(request).items():
                assert totals["fresh_buffers"] == 0 and totals["fresh_bytes"] == 0, (rank, index, component)


def test_the_paths_own_collective_runs_and_with_the_fix_no_site_is_unmanaged(census):
    path, _, summary = census
    assert summary["unmanaged_sites"]["whole"] == {}
    books = [book for _, _, request in requests_of(summary, "release") for book in request["books"].values()]
    released = [site for book in books for site in book]
    assert any(PATHS[path] in site for site in released), sorted(set(released))
    assert summary["unmanaged_sites"]["release"] != {}  # what the fix removes


def test_both_runs_compile_the_dit_and_staging_adds_no_graph_break_to_the_releases(census):
    _, _, summary = census
    for fix in ("release", "whole"):
        for rank in summary["runs"][fix]["ranks"]:
            assert all(c["dit_compiled"] for c in rank["compile"]), (fix, rank["rank"])
    breaks = {fix: [r["graph_breaks"] for r in ranks] for fix, ranks in summary["compile"].items()}
    assert all(staged <= released for staged, released in zip(breaks["whole"], breaks["release"], strict=True))
