# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The collective census end to end: two ``vllm-omni serve`` runs on four CPU ranks, fix off and on."""

from __future__ import annotations

import json

import pytest

from benchmarks import minimax_h3_pipeline_census as census_bench
from minimax_h3_gather.census import COMPONENTS

pytestmark = [
    pytest.mark.advanced_model,
    pytest.mark.cpu,
    pytest.mark.diffusion,
    pytest.mark.distributed,
    pytest.mark.integration,
]

REQUESTS = 2
SCHEMA = {
    "top": {"config", "versions", "runs", "media_identical", "projection"},
    "run": {"media_sha256", "ranks", "request_wall_s"},
    "request": {
        "new_registrations",
        "new_registered_bytes",
        "pinned_bytes",
        "registrations",
        "evictions",
        "barrier_temps",
        "calls",
        "new_by_site",
        "releases",
        "bookkeeping_errors",
        "timeline",
        "books",
    },
    "books": {
        "calls",
        "bytes_sent",
        "bytes_received",
        "fresh_buffers",
        "fresh_bytes",
        "persistent_buffers",
        "reused_buffers",
        "shapes",
    },
    "projection": {"formula", "scales", "dit_tokens", "fresh_MiB_per_request_rank0", "received_MiB_per_request_rank0"},
}


@pytest.fixture(scope="module")
def census(tmp_path_factory):
    out = tmp_path_factory.mktemp("census")
    argv = ["--requests", str(REQUESTS), "--output-dir", str(out), "--cache-dir", str(tmp_path_factory.mktemp("h3"))]
    code = census_bench.main(argv)
    return code, out, json.loads((out / "census.json").read_text())


def _requests(census, fix):
    return [(r["rank"], i, q) for r in census[2]["runs"][fix]["ranks"] for i, q in enumerate(r["requests"])]


def test_exits_zero_with_media_identical_and_writes_json_and_plot(census):
    code, out, summary = census
    assert code == 0 and summary["media_identical"]
    assert len(set(summary["runs"]["off"]["media_sha256"])) == 1  # identical requests, identical media
    assert (out / "census.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_video_vae_fresh_bytes_are_zero_after_request_1_with_the_fix_and_not_without(census):
    for rank, index, request in _requests(census, "on"):
        vae = census_bench.by_component(request)["video_vae"]
        assert vae["calls"] > 0
        if index > 0:
            assert vae["fresh_bytes"] == 0 and vae["persistent_buffers"] > 0, (rank, index, vae)
    for rank, _, request in _requests(census, "off"):
        vae = census_bench.by_component(request)["video_vae"]
        assert vae["fresh_bytes"] > 0 and vae["persistent_buffers"] == 0, (rank, vae)


def test_dit_and_text_encoder_collectives_are_present_and_attributed_on_every_rank(census):
    for fix in ("off", "on"):
        for rank, index, request in _requests(census, fix):
            totals = census_bench.by_component(request)
            assert totals["dit"]["calls"] > 0 and totals["text_encoder"]["calls"] > 0, (fix, rank, index)
            dit_ops = {site.split(" @ ")[0] for site in request["books"]["dit"]}
            assert {"all_reduce", "all_gather_into_tensor"} <= dit_ops
            # Only request control outside the components (0.30.0 all-reduces a cancellation flag per stage).
            for site, books in request["books"].get("other", {}).items():
                assert books["bytes_received"] <= 64 * books["calls"], (site, books)
    # The fix touches the VAE only: the DiT's books are the same with it off and on.
    off, on = (
        census_bench.by_component(census[2]["runs"][f]["ranks"][0]["requests"][-1])["dit"] for f in ("off", "on")
    )
    assert off == on


def test_every_request_shows_release_windows_between_components(census):
    for fix in ("off", "on"):
        for _, _, request in _requests(census, fix):
            assert request["releases"] >= 2
            steps = [step for step in request["timeline"] if step not in ("release", "other")]
            order = [step for i, step in enumerate(steps) if i == 0 or steps[i - 1] != step]
            assert order == ["text_encoder", "dit", "video_vae"], request["timeline"]


def test_census_json_schema_is_stable(census):
    summary = census[2]
    assert set(summary) == SCHEMA["top"] and set(summary["projection"]) == SCHEMA["projection"]  # TP: projected
    for fix in ("off", "on"):
        assert set(summary["runs"][fix]) == SCHEMA["run"]
        for _, _, request in _requests(census, fix):
            assert set(request) == SCHEMA["request"]
            assert request["bookkeeping_errors"] == 0  # every collective of the served request was booked
            assert set(request["books"]) <= set(COMPONENTS)
            assert all(set(b) == SCHEMA["books"] for sites in request["books"].values() for b in sites.values())
        for rank in summary["runs"][fix]["ranks"]:  # each rank's wall and CPU seconds, per request
            assert len(rank["timing"]) == len(rank["requests"])
            assert all(t["wall_s"] > 0 and t["cpu_s"] > 0 for t in rank["timing"])
        assert len(summary["runs"][fix]["request_wall_s"]) == len(summary["runs"][fix]["ranks"][0]["requests"])


def test_bad_arguments_are_refused_naming_the_value(capsys):
    for argv, message in ((["--requests", "0"], "--requests=0"), (["--layout", "pp"], "invalid choice")):
        with pytest.raises(SystemExit) as exc:
            census_bench.parse_args(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err
