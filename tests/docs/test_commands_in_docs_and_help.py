# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Every command's ``--help`` shows its defaults, what it needs and its exit status, and every command the docs show
uses only options its ``--help`` lists."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex

import pytest

from tests.docs.test_serve_commands_in_docs import DOCS
from tests.utils import REPO_ROOT

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

MODULES = (
    "benchmarks.pipeline_census",
    "benchmarks.pool_premise",
    "benchmarks.minimax_h3_vae_gather",
    "benchmarks.persistent_collectives_overhead",
    "xpu_collective_memory.reach",
    "tooling.serve_cpu",
    "tooling.upstream_patches",
)


def _parser(module: str) -> argparse.ArgumentParser:
    return importlib.import_module(module).build_parser()


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """``(where, module, argv)`` for each ``python -m <module> ...`` line of the docs' shell blocks."""
    found = []
    for path in DOCS:
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", path.read_text(), flags=re.S):
            for command in block.replace("\\\n", " ").splitlines():
                if "python -m " not in command:
                    continue
                argv = shlex.split(command.split(" #")[0])
                for module in (m for m in MODULES if m in argv):
                    where = f"{path.relative_to(REPO_ROOT)}: {command.strip()[:80]}"
                    found.append((where, module, argv[argv.index(module) + 1 :]))
    return found


COMMANDS = documented_commands()


def test_the_user_guide_holds_the_one_census_command_for_cards():
    census = [argv for _, module, argv in COMMANDS if module == "benchmarks.pipeline_census"]
    assert any({"--device", "--model"} <= set(argv) and "xpu" in argv for argv in census), census


@pytest.mark.parametrize("where,module,argv", COMMANDS, ids=[where for where, _, _ in COMMANDS])
def test_each_command_in_the_docs_uses_only_options_its_help_lists(where, module, argv):
    options = _parser(module)._option_string_actions
    unknown = [arg for arg in argv if arg.startswith("--") and arg.split("=")[0] not in options]
    assert not unknown, f"{where}: {unknown} not in {module}'s --help"


@pytest.mark.parametrize("module", MODULES)
def test_each_commands_help_shows_every_default_what_it_needs_and_its_exit_status(module, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per option: a default is never split across lines
    parser = _parser(module)
    text = parser.format_help()
    assert parser.prog == f"python -m {module}"
    assert "Needs:" in text and "Exit status:" in text and "2 on a bad argument" in text, text
    for action in parser._actions:
        if action.option_strings and action.default is not argparse.SUPPRESS:
            entry = _entry(text, action.option_strings[0])
            assert f"(default: {action.default})" in entry, entry


def _entry(text: str, option: str) -> str:
    """An option's entry in the help's option list: its line and the help below it, on one line."""
    options = text.split("options:\n", 1)[1]
    start = re.search(rf"^  {re.escape(option)}\b", options, re.M).start()
    end = re.search(r"^  -", options[start + 3 :], re.M)
    return " ".join(options[start : start + 3 + end.start() if end else None].split())


def test_the_census_help_offers_each_pipeline_its_layouts_and_its_seed_sizes():
    from benchmarks.pipeline_census import LAYOUTS

    text = _parser("benchmarks.pipeline_census").format_help()
    layout_help = _entry(text, "--layout")
    for pipeline, layouts in LAYOUTS.items():
        for layout in layouts:
            named = re.search(rf"\b{layout} \(([^)]*)\)", layout_help).group(1)
            assert named == "every pipeline" and all(layout in v for v in LAYOUTS.values()) or pipeline in named
    for model in ("MiniMax-H3", "Wan2.2", "Qwen-Image"):
        assert model in _entry(text, "--model") and f"for {model}" in _entry(text, "--height")
