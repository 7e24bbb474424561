# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Collectives inside ``torch.compile``d code on two gloo ranks, the layer off and on, as XPU runs the DiT.

Each function is compiled with ``dynamic=True`` and run on two input shapes; ``compile_ranks.checks`` runs
every backend and mode once per module, and each test asserts one property.
"""

from __future__ import annotations

import pytest

from tests.distributed import compile_ranks
from tests.utils import results_or_raise, run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.distributed]

WORLD = 2
TRACED = [f"traced/{backend}" for backend in compile_ranks.BACKENDS]
BREAKING = ("broadcast", "barrier", "async_all_reduce", "ring_batch")
ODD = [f"{name}/{backend}" for name in compile_ranks.odd_layouts(WORLD) for backend in ("aot_eager", "inductor")]


@pytest.fixture(scope="module")
def reports():
    return results_or_raise(run_ranks(compile_ranks.checks, WORLD, timeout_s=900, pg_timeout_s=120), WORLD)


@pytest.mark.parametrize("case", TRACED + list(BREAKING) + ODD)
def test_compiled_code_gives_the_same_bits_with_the_layer_on_and_off(reports, case):
    for report in reports:
        assert report["on"][case]["bits"] == report["off"][case]["bits"]


@pytest.mark.parametrize("case", ["traced/eager", "traced/aot_eager"])
def test_compiled_code_without_inductor_gives_the_uncompiled_bits(reports, case):
    for report in reports:
        assert report["on"][case]["bits"] == report["eager"]["traced"]


@pytest.mark.parametrize("case", TRACED)
def test_traced_collectives_stay_in_one_graph_with_the_layer(reports, case):
    for report in reports:
        assert report["on"][case]["graph_breaks"] == report["off"][case]["graph_breaks"] == 0
        assert report["on"][case]["graphs"] == 1


@pytest.mark.parametrize("case", BREAKING)
def test_where_the_plain_collective_breaks_the_graph_the_staged_one_breaks_it_no_more(reports, case):
    for report in reports:
        assert report["on"][case]["graph_breaks"] == report["off"][case]["graph_breaks"] > 0
        assert report["on"][case]["graphs"] == report["off"][case]["graphs"]


@pytest.mark.parametrize("case", TRACED + list(BREAKING))
def test_compiled_collectives_run_staged_at_run_time(reports, case):
    per_call = 6 if case in TRACED else 1  # six collectives in the traced function, one in each other
    for report in reports:
        assert report["staged"][case] == 2 * per_call  # two input shapes


@pytest.mark.parametrize("case", TRACED)
def test_compiled_collectives_hand_the_backend_only_workspaces(reports, case):
    assert all(report["handed_workspaces_only"][case] for report in reports)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_collective_whose_result_is_unused_still_runs_on_every_rank(reports, backend):
    for report in reports:
        assert report["staged"][f"unused/{backend}"] == 2 * 3  # two input shapes, three collectives each
        assert report["on"][f"unused/{backend}"]["bits"] == report["off"][f"unused/{backend}"]["bits"]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_gradients_through_a_compiled_collective_are_torchs_with_the_layer_on(reports, backend):
    # Compiled, torch's functional all-reduce also reduces the gradient, unlike the uncompiled one: the layer
    # traces such a call as torch does rather than through its custom op, which has no backward.
    for report in reports:
        assert report["on"][f"gradients/{backend}"] == report["off"][f"gradients/{backend}"]
        assert report["off"][f"gradients/{backend}"] != report["eager"]["gradients"]
