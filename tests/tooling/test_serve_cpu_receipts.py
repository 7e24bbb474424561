# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The serve log's receipts are attributed to the process that wrote them, even where vLLM's worker prefix is not.

Records come from vLLM's own logger, configured by the serve run's logging environment, in real subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tooling import serve_cpu

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

_EMIT = """
import os, sys
from vllm.utils.system_utils import _add_prefix
from vllm_omni.distributed.persistent_collectives import logger
_add_prefix(sys.stdout, "DiffusionWorker", os.getpid())
logger.info("[PERSISTENT_COLLECTIVES] persistent buffers in use in this process (first: %s)", "all_reduce")
"""


@pytest.fixture(scope="module")
def records() -> list[tuple[int, str]]:
    """Two processes' "persistent buffers in use" records, as ``(pid, line)``, each with vLLM's worker prefix."""
    env = os.environ | serve_cpu.RECEIPT_LOGGING | {"VLLM_LOGGING_COLOR": "0"}
    processes = [
        subprocess.Popen([sys.executable, "-c", _EMIT], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    lines = []
    for process in processes:
        out, _ = process.communicate(timeout=300)
        assert process.returncode == 0
        (line,) = [line for line in out.splitlines() if "[PERSISTENT_COLLECTIVES]" in line]
        assert line.startswith(f"(DiffusionWorker pid={process.pid}) ")
        lines.append((process.pid, line))
    return lines


def test_each_record_is_attributed_to_its_own_process(records):
    log = "\n".join(line for _, line in records) + "\n"
    assert serve_cpu.receipt_pids(log, "layer_installs") == {pid: 1 for pid, _ in records}


def test_a_record_keeps_its_process_when_another_workers_line_lands_between_its_prefix_and_its_text(records):
    (first, first_line), (second, second_line) = records
    prefix, record = first_line.split(") ", 1)
    # vLLM's prefixing writes "(Worker pid=N) " and the record in two writes; here the second worker's whole line
    # lands between the first worker's two, as it did in a four-worker serve log.
    log = prefix + ") " + second_line + "\n" + record + "\n"
    assert serve_cpu.receipt_pids(log, "layer_installs") == {first: 1, second: 1}
