# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Ulysses' all-to-all and Ring's exchange through persistent buffers in compiled code, on gloo ranks.

Wan2.2 runs both inside its regionally compiled transformer blocks; the eager module with the switch off is the
oracle.
"""

from __future__ import annotations

import pytest

from tests.distributed import sequence_parallel_ranks
from tests.distributed.ranks import results_or_raise, run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.parallel]

CASES = [f"{pattern}/aot_eager" for pattern in ("ulysses", "ring")]  # Inductor: test_inductor_on_ranks.py


@pytest.fixture(scope="module")
def compiled():
    return results_or_raise(run_ranks(sequence_parallel_ranks.compile_checks, 2, timeout_s=900), 2)


@pytest.mark.parametrize("case", CASES)
def test_compiled_the_switch_on_gives_the_results_of_the_switch_off(compiled, case):
    for report in compiled:
        assert report[case]["equal"], report[case]


@pytest.mark.parametrize("pattern", ["ulysses", "ring"])
def test_compiled_aot_eager_equals_the_eager_plain_module(compiled, pattern):
    assert all(report[f"{pattern}/aot_eager"]["equal_to_eager"] for report in compiled)


@pytest.mark.parametrize("case", CASES)
def test_compiled_with_persistent_buffers_the_backend_is_handed_only_blocks(compiled, case):
    for report in compiled:
        calls, unmanaged = report[case]["staged"]
        assert calls > 0 and unmanaged == 0, report[case]


@pytest.mark.parametrize("case", CASES)
def test_compiled_the_switch_changes_no_graph_break_and_ulysses_has_none(compiled, case):
    for report in compiled:
        off, on = report[case]["graph_breaks"]
        assert off == on and (off == 0 if case.startswith("ulysses") else off > 0), report[case]
