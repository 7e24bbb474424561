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

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.distributed]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("overhead")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "run_ranks", run_ranks)  # ranks import the working tree's modules
        code = bench.main(["--world-size", "2", "--pairs", "4", "--calls", "3", "--output-dir", str(out)])
    return code, json.loads((out / "results.json").read_text())


def test_every_size_and_rank_gets_wall_and_cpu_per_call_with_paired_intervals(run):
    code, results = run
    assert code == 0 and set(results["per_call"]) == set(bench.SIZES)
    for rows in results["per_call"].values():
        assert [row["rank"] for row in rows] == [0, 1]
        for row in rows:
            for clock in ("wall", "cpu"):
                ratio, extra = row[f"{clock}_ratio"], row[f"{clock}_extra_us"]
                assert ratio["pairs"] == extra["pairs"] == 4
                assert ratio["low"] <= ratio["value"] <= ratio["high"] and extra["low"] <= extra["high"]


def test_the_staged_calls_went_through_persistent_blocks(run):
    _, results = run
    calls_per_rank = len(bench.SIZES) * (1 + 4 * 3)  # a warm-up and every staged call
    assert [layer["staged_calls"] for layer in results["layer"]] == [calls_per_rank] * 2
    assert all(layer["fallbacks"] == 0 for layer in results["layer"])


@pytest.mark.parametrize(("argv", "least"), [(["--pairs", "1"], 2), (["--calls", "0"], 1), (["--world-size", "0"], 1)])
def test_bad_arguments_fail_naming_the_value(argv, least, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert f"{argv[0]}={argv[1]}: expected an integer >= {least}" in capsys.readouterr().err
