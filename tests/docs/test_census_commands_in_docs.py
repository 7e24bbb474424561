# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Every census command in the docs uses only options the census benchmark has."""

from __future__ import annotations

import re
import shlex

import pytest

from benchmarks.pipeline_census import build_parser
from tests.docs.test_serve_commands_in_docs import DOCS
from tests.utils import REPO_ROOT

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

MODULE = "benchmarks.pipeline_census"


def census_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in DOCS:
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", path.read_text(), flags=re.S):
            for command in block.replace("\\\n", " ").splitlines():
                if MODULE not in command:
                    continue
                argv = shlex.split(command.split(" #")[0])
                if MODULE in argv:
                    found.append(
                        (f"{path.relative_to(REPO_ROOT)}: {command.strip()[:80]}", argv[argv.index(MODULE) + 1 :])
                    )
    return found


COMMANDS = census_commands()


def test_the_user_guide_holds_the_one_command_for_cards():
    assert any({"--device", "--model"} <= set(argv) and "xpu" in argv for _, argv in COMMANDS), COMMANDS


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_each_census_command_uses_only_options_of_the_benchmark(where, argv):
    options = build_parser()._option_string_actions
    unknown = [arg for arg in argv if arg.startswith("--") and arg.split("=")[0] not in options]
    assert not unknown, f"{where}: {unknown} not in the census's --help"
