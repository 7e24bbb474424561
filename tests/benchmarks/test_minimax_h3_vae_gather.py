# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The benchmark end to end on four gloo ranks (small settings), and its argument checks."""

from __future__ import annotations

import json

import pytest

from benchmarks import minimax_h3_vae_gather as bench
from tests.utils import run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.parallel]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "run_ranks", run_ranks)  # ranks import the working tree's modules
        argv = ["--requests", "3", "--latent-frames", "4", "--micro-reps", "3", "--output-dir", str(out)]
        code = bench.main(argv + ["--cache-dir", str(tmp_path_factory.mktemp("h3"))])
    return code, out, json.loads((out / "results.json").read_text())


def test_exits_zero_with_identical_frames_and_writes_results_and_plot(run):
    code, out, results = run
    assert code == 0 and results["frames_identical"]
    assert (out / "pinned_memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    strategies = results["strategies"]
    assert set(strategies) == {"checkpoint", "recv-only", "ours"}
    assert len({row["frames_sha256"] for data in strategies.values() for row in data["requests"]}) == 1
    for data in strategies.values():
        assert len(data["requests"]) == 3
        # A gather is part of a decode: its median cannot exceed the decode's.
        assert 0 < data["gather_ms_median"] < data["decode_ms_median"]


def test_ours_registers_nothing_new_after_the_first_request_and_the_others_keep_growing(run):
    _, _, results = run
    strategies = results["strategies"]
    ours = strategies["ours"]["requests"]
    # Request 1 registers the workspace and the headers' buffer, both used for send and receive; then nothing.
    assert ours[0]["new_registrations"] == 2 and [r["new_registrations"] for r in ours[1:]] == [0, 0]
    assert {s for by in ours[0]["new_by_site"].values() for s in by} == {"send+recv"}
    assert len({r["pinned_bytes"] for r in ours}) == 1
    assert ours[-1]["pinned_bytes"] == ours[-1]["workspace_bytes"] + 256 * 14 * 8  # and the header buffer
    gathers = strategies["checkpoint"]["requests"][0]["calls"]  # calls the ledger saw in one request
    for name in ("checkpoint", "recv-only"):
        rows = strategies[name]["requests"]
        assert all(r["new_registrations"] > 0 for r in rows[1:])
        assert [r["pinned_bytes"] for r in rows] == sorted({r["pinned_bytes"] for r in rows})
    # The stock gather registers a send and a receive buffer at each of its two list all-gathers.
    assert all(r["new_registrations"] >= gathers for r in strategies["checkpoint"]["requests"][1:])
    sends = [s for r in strategies["recv-only"]["requests"][1:] for by in r["new_by_site"].values() for s in by]
    assert set(sends) == {"send"}  # receive side stable, send side fresh


def test_every_rank_reports_wall_and_cpu_time_and_paired_ratios_with_their_interval(run):
    _, _, results = run
    machine = results["machine"]
    assert machine["ranks"] == 4 and machine["torch_threads_per_rank"] >= 1
    assert machine["oversubscribed"] == (machine["cpu_count"] < 4)
    assert len(results["timing_per_rank"]) == 4
    for by_strategy in results["timing_per_rank"]:
        assert set(by_strategy) == {"checkpoint", "recv-only", "ours"}
        for medians in by_strategy.values():
            assert set(medians) == {f"{k}_ms" for k in bench._SERIES} and all(v > 0 for v in medians.values())
    assert set(results["comparisons"]) == {"ours/checkpoint", "ours/recv-only"}
    for per_rank in results["comparisons"].values():
        assert len(per_rank) == 4
        for comparison in per_rank:
            assert isinstance(comparison.pop("gathers_explain_decode"), bool)
            for name, estimate in comparison.items():
                assert estimate["low"] <= estimate["value"] <= estimate["high"], name
                assert estimate["pairs"] == 3 and estimate["confidence"] == 0.95  # 3 requests, 3 micro repetitions


def _seconds(decode: float, micro: float) -> dict[str, list[float]]:
    return {
        "gather_wall": [0.1, 0.1],
        "gather_cpu": [0.1, 0.1],
        "decode_wall": [decode, 2 * decode],  # the second request ran on a slower machine, for both strategies
        "decode_cpu": [decode, decode],
        "micro_wall": [micro, micro],
        "micro_cpu": [micro, micro],
        "request_gathers_wall": [0.2, 0.2],
        "request_gathers_cpu": [0.2, 0.2],
    }


def test_summary_pairs_the_strategies_and_flags_frames_that_differ():
    cfg = bench.Config("c", "cpu", 2, (1,), 2, None, ("checkpoint", "ours"), 1)
    rank = {
        "requests": {"checkpoint": [{"frames_sha256": "a"}], "ours": [{"frames_sha256": "b"}]},
        "seconds": {"checkpoint": _seconds(1.0, 0.2), "ours": _seconds(1.1, 0.1)},
    }
    summary = bench.summarize([rank], cfg)
    assert not summary["frames_identical"]
    (comparison,) = summary["comparisons"]["ours/checkpoint"]
    assert comparison["decode_wall_ratio"]["value"] == pytest.approx(1.1)  # the shared slowdown cancels
    assert comparison["micro_wall_ratio"]["value"] == pytest.approx(0.5)
    assert comparison["decode_wall_difference_ms"]["value"] == pytest.approx(150.0)
    assert not comparison["gathers_explain_decode"]  # the gathers took the same time: 150 ms came from elsewhere
    assert any("ours/checkpoint time ratio" in line for line in bench.format_timing(summary))


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--requests", "1"], "--requests=1: expected an integer >= 2"),
        (["--micro-reps", "0"], "--micro-reps=0"),
        (["--strategies", "ours,nccl"], "--strategies='ours,nccl'"),
        (["--strategies", "ours,ours"], "distinct"),
        (["--device", "cuda"], "invalid choice"),
        (["--ledger-limit", "-3"], "--ledger-limit=-3"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
