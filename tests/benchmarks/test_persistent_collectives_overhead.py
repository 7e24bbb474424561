# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The per-call cost benchmark on two gloo ranks (small settings): what it reports, and its argument checks.

No assertion reads a timing's size: on this machine noise moves every figure; the benchmark prints them.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import persistent_collectives_overhead as bench
from tests.utils import run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.parallel]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("overhead")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "run_ranks", run_ranks)  # ranks import the working tree's modules
        code = bench.main(["--world-size", "2", "--pairs", "4", "--calls", "3", "--output-dir", str(out)])
    return code, json.loads((out / "results.json").read_text())


def test_every_size_and_rank_gets_wall_and_cpu_per_call_of_each_caller_and_paired_intervals_of_both_gaps(run):
    code, results = run
    assert code == 0 and set(results["per_call"]) == set(bench.SIZES)
    for rows in results["per_call"].values():
        assert [row["rank"] for row in rows] == [0, 1]
        for row in rows:
            for clock in bench.CLOCKS:
                assert all(row[f"{clock}_{name}_us"] > 0 for name in bench.CALLERS)
                for high, low in bench.COMPARISONS:
                    gap = f"{high}_minus_{low}"
                    extra = row[f"{clock}_{gap}_us"]
                    assert extra["pairs"] == 4 and extra["low"] <= extra["value"] <= extra["high"]


def test_the_staged_calls_went_through_persistent_blocks_and_the_others_did_not(run):
    _, results = run
    calls_per_rank = 2 * len(bench.SIZES) * (1 + 4) * 3  # staged and staged_host: warm-up and kept rounds
    assert [layer["staged_calls"] for layer in results["layer"]] == [calls_per_rank] * 2
    assert all(layer["fallbacks"] == 0 for layer in results["layer"])


@pytest.mark.parametrize(("argv", "least"), [(["--pairs", "1"], 2), (["--calls", "0"], 1), (["--world-size", "0"], 1)])
def test_bad_arguments_fail_naming_the_value(argv, least, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert f"{argv[0]}={argv[1]}: expected an integer >= {least}" in capsys.readouterr().err
