# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Every ``vllm-omni serve`` command in the docs parses with the installed vLLM-Omni's own serve parser.

CI runs this on vLLM-Omni 0.28.0 and 0.30.0, so a flag either release lacks (or renames) fails here rather than
on an operator's machine. The parser is built in a subprocess: importing vLLM-Omni's API server on this CPU
stack needs the start-up stand-ins of the test-only CPU platform, which apply only from interpreter start.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.utils import REPO_ROOT

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.integration]

DOCS = sorted([REPO_ROOT / "README.md", *(REPO_ROOT / "docs").rglob("*.md")])
# vllm-omni's CLI hands a command without --omni to plain vLLM, whose serve has none of the omni flags.
PARSE = """
import contextlib, io, json, sys
from vllm_omni.entrypoints.cli.serve import OmniServeCommand, _ensure_vllm_platform
from vllm_omni.utils.tracking_parser import TrackingArgumentParser

_ensure_vllm_platform()
results = []
for argv in json.loads(sys.stdin.read()):
    root = TrackingArgumentParser()
    OmniServeCommand().subparser_init(root.add_subparsers(dest="subparser"))
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            root.parse_args(argv)
        results.append(None)
    except SystemExit:
        results.append(errors.getvalue().strip().splitlines()[-1])
print("RESULTS" + json.dumps(results))
"""


def serve_commands() -> list[tuple[str, list[str]]]:
    """``(where, argv after 'vllm-omni')`` for each serve command in a fenced code block of the docs."""
    found = []
    for path in DOCS:
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", path.read_text(), flags=re.S):
            for command in block.replace("\\\n", " ").splitlines():
                command = command.split(" #")[0].strip()
                if command.startswith("vllm-omni serve"):
                    argv = shlex.split(re.sub(r"<[^>]+>", "MODEL", command))[1:]
                    found.append((f"{path.relative_to(REPO_ROOT)}: {command[:80]}", argv))
    return found


COMMANDS = serve_commands()


def test_the_docs_hold_serve_commands_with_the_recipes_flags():
    assert COMMANDS, "no vllm-omni serve command found in the docs"
    recipe = {"--vae-patch-parallel-size", "--vae-parallel-mode", "--vae-use-tiling", "--tensor-parallel-size"}
    assert any(recipe <= {arg.split("=")[0] for arg in argv} for _, argv in COMMANDS)


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_each_serve_command_goes_to_vllm_omni_not_plain_vllm(where, argv):
    assert "--omni" in argv, f"{where}: without --omni, vllm-omni runs plain vLLM's serve"


@pytest.fixture(scope="module")
def parse_results():
    env = os.environ | {"VLLM_OMNI_CPU_TEST_PLATFORM": "1"}
    done = subprocess.run(
        [sys.executable, "-c", PARSE],
        input=json.dumps([argv for _, argv in COMMANDS]),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    marker = [line for line in done.stdout.splitlines() if line.startswith("RESULTS")]
    assert done.returncode == 0 and marker, done.stderr[-3000:]
    return json.loads(marker[0].removeprefix("RESULTS"))


@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=[where for where, _ in COMMANDS])
def test_each_serve_command_parses_with_the_installed_vllm_omni(parse_results, index):
    where, _ = COMMANDS[index]
    assert parse_results[index] is None, f"{where}: {parse_results[index]}"
