# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The collective census end to end: four ``vllm-omni serve`` runs on four CPU ranks: VAE only, whole request staged,
whole request in the request pool (the CPU test platform's stand-in for the pool API: when, not where), and the release
without this project's fix (also what the plugin runs at ``0``).

Served on vLLM-Omni 0.30.0, the release the patches target and ``requirements/xpu.txt`` installs: its request path is
0.28.0's plus the pipeline's object collectives on the world's device group. 0.28.0's is the reach check's and the
serve test's.
"""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest

from benchmarks import pipeline_census as census_bench
from tooling import serve_cpu, upstream_patches
from xpu_collective_memory.census import COMPONENTS

pytestmark = [
    pytest.mark.advanced_model,
    pytest.mark.cpu,
    pytest.mark.diffusion,
    pytest.mark.parallel,
    pytest.mark.integration,
    pytest.mark.skipif(version("vllm-omni") != upstream_patches.RELEASE, reason="served on 0.30.0 (.venv-omni-0.30)"),
]

REQUESTS = 3
SCHEMA = {
    "top": {
        "config",
        "versions",
        "runs",
        "media_identical",
        "media_groups",
        "media_difference",
        "compile",
        "unmanaged_sites",
        "memory_growth",
        "paired_timing",
        "projection",
    },
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
        "unmanaged_sites",
        "staged_bytes",
        "outside_pool_context",
        "outside_pool_stable",
        "outside_pool_fresh",
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
    "projection": {
        "formula",
        "scales",
        "dit_tokens",
        "fresh_MiB_per_request_rank0",
        "received_MiB_per_request_rank0",
        "layer",
    },
    "rank": {"rank", "requests", "timing", "persistent_collectives", "memory", "compile", "pool"},
}


@pytest.fixture(scope="module")
def census(tmp_path_factory):
    out = tmp_path_factory.mktemp("census")
    argv = ["--requests", str(REQUESTS), "--output-dir", str(out), "--cache-dir", str(tmp_path_factory.mktemp("h3"))]
    code = census_bench.main(argv)
    return code, out, json.loads((out / "census.json").read_text())


def _requests(census, fix):
    return census_bench.requests_of(census[2], fix)


RUNS = ["vae", "whole", "pool", "release"]


def test_exits_zero_with_media_identical_unstaged_and_staged_the_releases_once_decoded_and_writes_json_and_plot(
    census,
):
    code, out, summary = census
    assert code == 0 and summary["media_identical"] and list(summary["runs"]) == RUNS
    # Inductor fuses the DiT's code around the registered ops otherwise than around torch's functional collectives.
    assert summary["media_groups"] == [["whole"], ["vae", "pool", "release"]]
    assert set(summary["media_difference"]) == {"vae", "whole", "pool"}
    for fix, requests in summary["media_difference"].items():
        for difference in requests:
            # The audio is AAC-coded: a last-bit change moves its samples more (reported, not asserted, for whole).
            assert difference["psnr_db"] >= (35 if fix == "whole" else float("inf")), (fix, difference)
            assert fix == "whole" or difference["audio_snr_db"] == float("inf"), (fix, difference)
    for group in summary["media_groups"]:
        digests = {tuple(summary["runs"][fix]["media_sha256"]) for fix in group}
        assert len(digests) == 1 and len(set(next(iter(digests)))) == 1  # identical requests, identical media
    assert (out / "census.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_video_vae_fresh_bytes_are_zero_after_request_1_with_either_fix_and_not_without(census):
    for fix in ("vae", "whole"):
        for rank, index, request in _requests(census, fix):
            vae = census_bench.by_component(request)["video_vae"]
            assert vae["calls"] > 0
            if index > 0:
                assert vae["fresh_bytes"] == 0 and vae["persistent_buffers"] > 0, (fix, rank, index, vae)
    for rank, _, request in _requests(census, "release"):
        vae = census_bench.by_component(request)["video_vae"]
        assert vae["fresh_bytes"] > 0 and vae["persistent_buffers"] == 0, (rank, vae)


def test_with_the_whole_request_fix_no_component_hands_the_backend_a_fresh_buffer_after_request_1(census):
    for rank, index, request in _requests(census, "whole"):
        for component, totals in census_bench.by_component(request).items():
            if index > 0:
                assert totals["fresh_bytes"] == 0 and totals["fresh_buffers"] == 0, (rank, index, component)
    for fix in ("release", "vae"):  # without the layer, the text encoder and the DiT still do, every request
        for rank, _, request in _requests(census, fix):
            totals = census_bench.by_component(request)
            assert totals["dit"]["fresh_buffers"] > 0 and totals["text_encoder"]["fresh_buffers"] > 0, (fix, rank)


def test_with_the_whole_fix_barriers_hand_the_backend_no_temporary_and_without_it_they_do(census):
    assert all(request["barrier_temps"] == 0 for _, _, request in _requests(census, "whole"))
    assert all(request["barrier_temps"] > 0 for _, _, request in _requests(census, "release"))


def test_object_collectives_are_counted_by_call_site_and_staged_with_the_whole_fix(census):
    # 0.30.0's pipeline broadcasts and gathers Python objects on the world's device group every request.
    sites = {
        fix: {site for _, _, q in _requests(census, fix) for books in q["books"].values() for site in books}
        for fix in ("release", "whole")
    }
    labelled = {fix: {site for site in found if "_object" in site.split(" @ ")[0]} for fix, found in sites.items()}
    assert labelled["release"] and labelled["whole"], labelled
    for rank, index, request in _requests(census, "whole"):
        for books in request["books"].values():
            for site, site_books in books.items():
                if "_object" in site.split(" @ ")[0] and index > 0:
                    assert site_books["fresh_buffers"] == 0, (rank, index, site)


def test_the_persistent_collectives_stop_allocating_after_request_1_and_never_fall_back(census):
    for rank in census[2]["runs"]["whole"]["ranks"]:
        rows = census_bench.layer_per_request(rank)
        assert len(rows) == REQUESTS and rows[0]["block_allocations"] > 0
        assert [r["block_allocations"] for r in rows[1:]] == [0] * (REQUESTS - 1)
        assert all(r["fallbacks"] == 0 and r["staged_calls"] > 0 and r["resident_bytes"] > 0 for r in rows)
    for fix in ("release", "vae"):
        assert all(census_bench.layer_per_request(r) == [] for r in census[2]["runs"][fix]["ranks"])


def test_the_copy_traffic_the_fix_adds_is_reported_per_request_and_component_and_stays_within_twice_the_payload(
    census,
):
    for rank in census[2]["runs"]["whole"]["ranks"]:
        for row, request in zip(census_bench.layer_per_request(rank), rank["requests"], strict=True):
            assert 0 < row["staged_bytes"] <= 2 * row["payload_bytes"]  # at most one copy in and one out
            assert sum(request["staged_bytes"].values()) == row["staged_bytes"]  # every copy booked to a component
            assert request["staged_bytes"]["dit"] > 0
            assert row["resident_bytes"] <= row["block_cap_bytes"]  # the synthetic calls are all below the cap
    for rank in census[2]["runs"]["release"]["ranks"]:
        assert all(request["staged_bytes"] == {} for request in rank["requests"])


def test_with_the_whole_fix_no_request_has_an_unmanaged_site_and_without_it_the_dit_and_barriers_are_some(census):
    # The guard for new call sites: a collective on a device group that hands the backend anything but blocks.
    summary = census[2]
    assert summary["unmanaged_sites"]["whole"] == {}
    assert all(request["unmanaged_sites"] == {} for _, _, request in _requests(census, "whole"))
    for fix in ("release", "vae"):
        ops = {site.split(" @ ")[0] for site in summary["unmanaged_sites"][fix]}
        assert {"all_reduce", "barrier", "broadcast"} <= ops, (fix, ops)


def test_dit_and_text_encoder_collectives_are_present_and_attributed_on_every_rank(census):
    for fix in RUNS:
        for rank, index, request in _requests(census, fix):
            totals = census_bench.by_component(request)
            assert totals["dit"]["calls"] > 0 and totals["text_encoder"]["calls"] > 0, (fix, rank, index)
            dit_ops = {site.split(" @ ")[0] for site in request["books"]["dit"]}
            # Routed, the coordinator gathers with all_gather_single; as released, with all_gather_into_tensor.
            assert "all_reduce" in dit_ops and dit_ops & {"all_gather_single", "all_gather_into_tensor"}, dit_ops
            # Only request control outside the components: 0.30.0 all-reduces a cancellation flag per stage, and
            # its pipeline broadcasts Python objects (errors, media headers) that the census labels as such.
            for site, books in request["books"].get("other", {}).items():
                is_object_collective = "_object" in site.split(" @ ")[0]
                assert is_object_collective or books["bytes_received"] <= 64 * books["calls"], (site, books)
    # The VAE fix touches the VAE only; the layer changes no call and no byte moved, only which buffers.
    runs = census[2]["runs"]
    last = {fix: census_bench.by_component(runs[fix]["ranks"][0]["requests"][-1]) for fix in runs}
    assert last["release"]["dit"] == last["vae"]["dit"]
    moved = ("calls", "bytes_sent", "bytes_received")
    assert all(last["pool"]["dit"][key] == last["release"]["dit"][key] for key in moved)
    # Staged, the coordinator gathers in place (all_gather_single), which books its input as its slot of the output.
    assert last["whole"]["dit"]["calls"] == last["release"]["dit"]["calls"]
    for key in moved[1:]:
        assert abs(last["whole"]["dit"][key] - last["release"]["dit"][key]) <= last["release"]["dit"][key] / 1000


def test_every_request_shows_release_windows_between_components(census):
    for fix in RUNS:
        for _, _, request in _requests(census, fix):
            assert request["releases"] >= 2
            steps = [step for step in request["timeline"] if step not in ("release", "other")]
            order = [step for i, step in enumerate(steps) if i == 0 or steps[i - 1] != step]
            assert order == ["text_encoder", "dit", "video_vae"], request["timeline"]


def test_every_run_compiles_the_dit_as_xpu_does_and_only_staging_changes_the_releases_graph_breaks(census):
    summary = census[2]
    assert summary["config"]["dit_compile"]
    for fix in RUNS:
        for rank in summary["runs"][fix]["ranks"]:
            assert [c["dit_compiled"] for c in rank["compile"]] == [True] * REQUESTS, (fix, rank["rank"])
    breaks = {fix: [r["graph_breaks"] for r in ranks] for fix, ranks in summary["compile"].items()}
    assert breaks["vae"] == breaks["pool"] == breaks["release"], breaks  # neither routes a collective
    assert all(staged <= released for staged, released in zip(breaks["whole"], breaks["release"], strict=True))


def test_census_json_and_its_table_name_this_projects_version_beside_vllm_omnis_and_torchs(census):
    summary = census[2]
    names = ["vllm-omni-xpu-collective-memory", "vllm-omni", "torch"]
    assert summary["versions"] == {name: version(name) for name in names}
    running = ", ".join(f"{name} {version(name)}" for name in names)
    assert census_bench.format_table(summary).splitlines()[0] == f"census of {running}"


def test_census_json_schema_is_stable(census):
    summary = census[2]
    assert set(summary) == SCHEMA["top"] and set(summary["projection"]) == SCHEMA["projection"]  # TP: projected
    assert summary["projection"]["layer"]["resident_MiB_rank0"] > 0
    for fix in RUNS:
        assert set(summary["runs"][fix]) == SCHEMA["run"]
        assert all(set(rank) == SCHEMA["rank"] for rank in summary["runs"][fix]["ranks"])
        for _, _, request in _requests(census, fix):
            assert set(request) == SCHEMA["request"]
            assert request["bookkeeping_errors"] == 0  # every collective of the served request was booked
            assert set(request["books"]) <= set(COMPONENTS)
            assert all(set(b) == SCHEMA["books"] for sites in request["books"].values() for b in sites.values())
        for rank in summary["runs"][fix]["ranks"]:  # each rank's wall and CPU seconds, per request
            assert len(rank["timing"]) == len(rank["requests"])
            assert all(t["wall_s"] > 0 and t["cpu_s"] > 0 for t in rank["timing"])
        assert len(summary["runs"][fix]["request_wall_s"]) == len(summary["runs"][fix]["ranks"][0]["requests"])


def test_the_side_by_side_runs_give_paired_ratios_per_rank_with_intervals(census):
    paired = census[2]["paired_timing"]
    ranks = [f"rank{r}_{key}" for r in range(4) for key in ("wall_s", "cpu_s")]
    assert set(paired) == {"client_wall", *ranks}
    for estimate in paired.values():
        assert estimate["pairs"] == REQUESTS - 1 and estimate["low"] <= estimate["value"] <= estimate["high"]


def test_every_worker_samples_memory_after_each_request_as_rss_labelled_as_the_ledgers_cost(census):
    for fix, run in census[2]["runs"].items():
        for rank in run["ranks"]:
            assert len(rank["memory"]) == REQUESTS, (fix, rank["rank"])
            for sample in rank["memory"]:
                assert set(sample) == {"device", "rss_bytes", "label"} and sample["device"] == "cpu"
                assert sample["rss_bytes"] > 0 and "not a device figure" in sample["label"]


def test_the_seed_table_has_per_rank_growth_between_consecutive_requests_for_each_run(census):
    table = census[2]["memory_growth"]
    assert list(table) == RUNS
    for fix, rows in table.items():
        assert [row["rank"] for row in rows] == [0, 1, 2, 3], fix
        for row in rows:
            assert row["metric"] == "rss_bytes" and len(row["after_request_MiB"]) == REQUESTS
            after = row["after_request_MiB"]
            assert row["growth_MiB"] == [b - a for a, b in zip(after, after[1:], strict=False)]
    text = census_bench.format_table(census[2])
    assert (
        "memory per rank (process RSS on CPU ranks" in text and "growth 1->2 MiB" in text and "growth 2->3 MiB" in text
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--requests", "0"], "--requests=0"),
        (["--layout", "dp"], "invalid choice"),
        (["--model", "/no/such/checkpoint"], "--model=/no/such/checkpoint: expected a checkpoint directory"),
        (["--layout", "cfg"], "--layout=cfg: expected one of ['hsdp', 'ring', 'tp', 'ulysses'] for minimax_h3"),
        (["--pipeline", "flux"], "invalid choice: 'flux'"),
        (["--height", "768"], "--height, --width, --num-frames and --steps need --model"),
        (["--device", "gpu"], "invalid choice: 'gpu'"),
        (["--pipeline", "qwen_image", "--model", "QWEN", "--num-frames", "9"], "--num-frames=9: Qwen-Image makes one"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(capsys, tmp_path, argv, message):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    with pytest.raises(SystemExit) as exc:
        census_bench.parse_args([str(tmp_path) if arg == "QWEN" else arg for arg in argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("plugins", "missing"),
    [
        ("xpu_collective_memory", "xpu_collective_census"),
        ("cpu_test", "xpu_collective_memory and xpu_collective_census"),
    ],
)
def test_vllm_plugins_without_the_fix_or_the_census_is_refused_naming_what_to_add(
    monkeypatch, capsys, plugins, missing
):
    monkeypatch.setenv("VLLM_PLUGINS", plugins)
    with pytest.raises(SystemExit) as exc:
        census_bench.parse_args([])
    assert exc.value.code == 2
    assert f"VLLM_PLUGINS={plugins!r}: the A/B needs {missing} in it too, or unset it" in capsys.readouterr().err


def test_device_xpu_without_an_xpu_is_refused_at_once(capsys, tmp_path):
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(SystemExit) as exc:  # this machine has no XPU
        census_bench.parse_args(["--device", "xpu", "--model", str(tmp_path)])
    assert exc.value.code == 2
    assert "--device xpu: this machine has no XPU that torch can use" in capsys.readouterr().err


def _checkpoint(path, class_name):
    path.mkdir(exist_ok=True)
    (path / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    return str(path)


def test_a_checkpoint_of_another_pipeline_or_against_pipeline_is_refused_naming_it(capsys, tmp_path):
    for argv, message in (
        (["--model", _checkpoint(tmp_path / "flux", "FluxPipeline")], "expected a checkpoint of one of"),
        (
            ["--model", _checkpoint(tmp_path / "wan", "WanPipeline"), "--pipeline", "minimax_h3"],
            "is a wan2_2 checkpoint",
        ),
    ):
        with pytest.raises(SystemExit) as exc:
            census_bench.parse_args(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_wan2_2_checkpoint_is_served_as_wan2_2_with_its_own_request_and_true_cfg(tmp_path):
    args = census_bench.parse_args(["--model", _checkpoint(tmp_path, "WanPipeline"), "--layout", "cfg"])
    assert args.pipeline == "wan2_2"
    request = census_bench.seed_request(args)
    assert (request["height"], request["width"], request["num_frames"]) == (480, 832, 81)
    assert request["guidance_scale"] > 1 and request["negative_prompt"]


def test_a_real_checkpoint_gets_the_seeds_request_unless_told_otherwise(tmp_path):
    _checkpoint(tmp_path, "MiniMaxH3Pipeline")
    args = census_bench.parse_args(["--model", str(tmp_path), "--steps", "4"])
    assert census_bench.seed_request(args) == {
        "height": 768,
        "width": 1344,
        "num_frames": 209,
        "num_inference_steps": 4,
    }
    assert census_bench.seed_request(census_bench.parse_args([])) is None
    with pytest.raises(SystemExit):
        census_bench.parse_args(["--model", str(tmp_path), "--num-frames", "0"])


def test_in_pool_mode_every_rank_ran_each_request_forward_in_its_one_pool_and_made_no_device_call_outside_it(census):
    code, out, summary = census
    for rank in summary["runs"]["pool"]["ranks"]:
        entered = [{"in_pool": True, "requests_entered": index} for index in range(1, REQUESTS + 1)]
        assert rank["pool"] == entered, rank["rank"]  # the forward runs every component: all inside
        assert all(request["outside_pool_context"] == {} for request in rank["requests"]), rank["rank"]
    for fix in ("release", "vae", "whole"):
        assert all(rank["pool"] == [None] * REQUESTS for rank in summary["runs"][fix]["ranks"]), fix
    log = (out / "tp-pool" / "server.log").read_text(errors="replace")
    made = serve_cpu.receipt_pids(log, "pools_made")
    assert sorted(made.values()) == [1] * serve_cpu.WORLD  # one pool per worker, made once, at start-up
    assert serve_cpu.receipt_pids(log, "pool_entries").keys() == made.keys()


def test_in_pool_mode_every_collective_is_torchs_own_no_block_is_made_and_nothing_is_copied(census):
    summary = census[2]
    for rank in summary["runs"]["pool"]["ranks"]:
        for row in census_bench.layer_per_request(rank):
            assert row["staged_calls"] == 0 and row["fallbacks"] == 0, rank["rank"]
            assert row["blocks"] == 0 and row["resident_bytes"] == 0 and row["staged_bytes"] == 0, rank["rank"]
        assert all(request["staged_bytes"] == {} for request in rank["requests"])
    # Every call hands the backend memory of the pool (or the VAE gather's own workspace): none is unmanaged.
    assert summary["unmanaged_sites"]["pool"] == {}
    assert all(census_bench.layer_per_request(rank) for rank in summary["runs"]["whole"]["ranks"])
    text = census_bench.format_table(summary)
    assert "in the pool 3/3; outside it per request [0, 0, 0]" in text and "test platform's stand-in" in text
    # Memory outside the pool in a request (weights, buffers made at load) keeps its addresses from request 2 on.
    assert f"fresh from request 2 on, per rank: {[0] * serve_cpu.WORLD}" in text, text
