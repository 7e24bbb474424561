# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The docs point at what exists and count what the code has: links and anchors resolve, paths and ``python -m``
modules exist, and the arms, layouts, pipelines and patches they state are the code's."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from benchmarks.pipeline_census import CLASS_NAMES, LAYOUTS, PIPELINE_RUNS
from tests.docs.test_serve_commands_in_docs import DOCS
from tests.utils import REPO_ROOT
from tooling.upstream_patches import DOC_BEGIN, DOC_END

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

GUIDE = REPO_ROOT / "docs" / "user_guide" / "xpu_collective_memory.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A path of this project in backticks: it starts at one of the checkout's top-level folders (not out/, which the
# docs name as where results go), or at a package's name before 0.12.0 (gone, so a stale path fails).
FOLDERS = ("vllm_omni", "xpu_collective_memory", "tooling", "benchmarks", "tests", "scripts", "requirements", "docs")
TOP = "|".join([*FOLDERS, "patches", "minimax_h3_\\w+"])
OWN_PATH = re.compile(rf"`((?:{TOP})/[\w./-]+)`")
NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def _where(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=_where)
def test_every_link_resolves_to_a_file_and_every_anchor_to_a_heading(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {_where(linked)}")
    assert not broken, f"{_where(doc)}: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=_where)
def test_every_path_of_this_project_the_docs_name_exists(doc):
    import vllm_omni

    released = Path(vllm_omni.__file__).parent.parent  # vLLM-Omni's own paths are named too
    # The series' section names the 0.30.0 tree's files, written from the patches (tests/patches checks it).
    text = re.sub(rf"{re.escape(DOC_BEGIN)}.*?{re.escape(DOC_END)}", "", doc.read_text(), flags=re.S)
    missing = []
    for named in OWN_PATH.findall(text):
        path = named.split("<")[0].rstrip("/")
        upstream_test = REPO_ROOT / "tooling" / "upstream_tests" / path  # upstream's own, as a patch changes it
        if not ((REPO_ROOT / path).exists() or (released / path).exists() or upstream_test.exists()):
            missing.append(named)
    assert not missing, f"{_where(doc)} names paths that exist neither here nor in vllm_omni: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_where)
def test_every_python_dash_m_module_the_docs_name_can_be_run(doc):
    modules = set(re.findall(r"python -m ([A-Za-z_][\w.]*)", doc.read_text())) - {"pip", "pytest", "venv"}
    missing = sorted(m for m in modules if importlib.util.find_spec(m) is None)
    assert not missing, f"{_where(doc)}: {missing}"


def _table(path: Path, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header row starts with ``header``, cells without backticks."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().replace("`", "") for cell in line.strip("|").split("|")])
    return rows


def _names(cell: str) -> list[str]:
    return [name.strip() for name in cell.split(",")]


def test_the_guides_arms_per_pipeline_are_the_censuss_in_its_order():
    rows = _table(GUIDE, "| pipeline | `model_index.json` class | arms |")
    assert {pipeline: tuple(_names(arms)) for pipeline, _, arms in rows} == PIPELINE_RUNS
    assert {cls: pipeline for pipeline, cls, _ in rows} == CLASS_NAMES


def test_the_guides_layouts_per_pipeline_are_the_censuss():
    rows = _table(GUIDE, "| pipeline | layouts |")
    assert {pipeline: set(_names(layouts)) for pipeline, layouts in rows} == {p: set(v) for p, v in LAYOUTS.items()}


def test_the_readmes_support_table_lists_each_pipelines_layouts():
    by_model = {"MiniMax-H3": "minimax_h3", "Wan2.2": "wan2_2", "Qwen-Image": "qwen_image"}
    rows = _table(REPO_ROOT / "README.md", "| model | layouts | in CI |")
    counted = {next(p for m, p in by_model.items() if model.startswith(m)): len(_names(lay)) for model, lay, _ in rows}
    assert counted == {pipeline: len(layouts) for pipeline, layouts in LAYOUTS.items()}


@pytest.mark.parametrize("doc", DOCS, ids=_where)
def test_counts_of_arms_pipelines_and_patches_the_docs_state_are_the_codes(doc):
    expected = {
        "arms": {len(runs) for runs in PIPELINE_RUNS.values()},
        "pipelines": {len(PIPELINE_RUNS)},
        "patches": {len(list((REPO_ROOT / "patches").glob("*.patch")))},
    }
    wrong = []
    for number, noun in re.findall(r"\b(two|three|four|five|six|seven|eight|nine|ten|\d+) (arms|pipelines|patches)\b",
                                   doc.read_text()):  # fmt: skip
        stated = NUMBERS.get(number) or int(number)
        if stated not in expected[noun]:
            wrong.append(f"{number} {noun} (the code has {sorted(expected[noun])})")
    assert not wrong, f"{_where(doc)}: {wrong}"
