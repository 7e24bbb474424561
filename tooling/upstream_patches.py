# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The upstream change as a ``git format-patch`` series against the released vLLM-Omni 0.30.0 package tree.

vLLM-Omni publishes no sdist after 0.20.0, so the reference is the 0.30.0 wheel's ``vllm_omni`` tree, fetched
fresh (the installed copy carries this project's overlay). Each patch owns the new files it carries whole, taken
from this checkout (``SERIES``); its edits to release files and its message live in the patch. Run from the 0.30.0
environment:

    python -m tooling.upstream_patches check                # pristine tree, each patch checked then applied
    python -m tooling.upstream_patches test                 # each prefix: its last patch's own tests, plugin off;
                                                            # then the serve and Inductor tests on the whole series
    python -m tooling.upstream_patches test --prefix 3      # the first three patches, the third's tests
    python -m tooling.upstream_patches regenerate           # every patch's owned files as this checkout has them
                                                            # (each of these fetches the 0.30.0 wheel with pip)
    python -m tooling.upstream_patches regenerate --tree T  # messages and release edits from T's commits instead
"""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

from xpu_collective_memory.renamed import ENTRY_POINTS, PLUGIN

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches"
RELEASE = "0.30.0"
TREE_ENV = "VLLM_OMNI_TEST_UPSTREAM_TREE"  # the test suite then runs that tree's code, not this checkout's
# Upstream's own test files that a patch changes, as its repository has them at 0.30.0 (the wheel ships no tests).
UPSTREAM_TESTS = ROOT / "tooling" / "upstream_tests"
DOC = ROOT / "docs" / "contributing" / "upstream_pr.md"  # its section on the series is written from the patches
DOC_BEGIN = "<!-- The series: written from patches/ by python -m tooling.upstream_patches regenerate. -->"
DOC_END = "<!-- End of the series. -->"
MAX_ADDED = 400  # added non-test lines a patch may have; a larger one says why under this heading
LARGER_HEADING = "Why more than 400 lines"


@dataclass(frozen=True)
class Patch:
    """One pull request: the files it adds whole from this checkout (none of them touched by another patch)."""

    topic: str
    owns: tuple[str, ...]
    retests: tuple[str, ...] = ()  # an earlier patch's tests of a release file this one edits again

    @property
    def tests(self) -> tuple[str, ...]:
        return (*(path for path in self.owns if Path(path).name.startswith("test_")), *self.retests)


def _under(folder: str, *names: str) -> tuple[str, ...]:
    return tuple(f"{folder}/{name}" for name in names)


SERIES = (
    Patch(
        "the MiniMax-H3 VAE's tile gather into memory that stays put",
        (
            "vllm_omni/diffusion/models/minimax_h3/vae_gather.py",
            "vllm_omni/distributed/collective_workspaces.py",
            *_under(
                "tests/diffusion/models/minimax_h3",
                "__init__.py",
                "conftest.py",
                "fake_collective.py",
                "stand_ins.py",
                "bad_input_cases.py",
                "test_vae_gather.py",
                "test_vae_gather_bad_input.py",
            ),
        ),
    ),
    Patch(
        "the request pool: each request of a diffusion worker in one private memory pool the worker keeps",
        (
            "vllm_omni/distributed/request_pool.py",
            *_under("tests/distributed", "__init__.py", "mem_pool_stand_in.py", "test_request_pool.py"),
        ),
    ),
    Patch(
        "staged collectives at the coordinator and the platform, eager",
        (
            "vllm_omni/distributed/persistent_collectives.py",
            "vllm_omni/distributed/request_collectives.py",
            *_under(
                "tests/distributed",
                "ranks.py",
                "collective_ranks.py",
                "coordinator_ranks.py",
                "test_persistent_collectives.py",
                "test_group_coordinator.py",
            ),
        ),
    ),
    Patch(
        "the coordinator's staged collectives compiled whole, through registered ops",
        (
            "vllm_omni/distributed/traced_collectives.py",
            *_under("tests/distributed", "traced_ranks.py", "test_traced_collectives.py"),
        ),
        # It adds the compiled branch to the coordinator's methods: the coordinator's compiled tests.
        retests=tuple(
            f"tests/distributed/test_group_coordinator.py::test_{name}"
            for name in (
                "compiled_with_staging_off_the_graph_holds_torchs_functional_collectives_and_none_of_ours",
                "compiled_with_staging_on_every_collective_reaches_the_backend_through_blocks_with_the_plain_bits",
            )
        ),
    ),
    Patch(
        "FSDP2's parameter all-gather into persistent blocks",
        (
            "vllm_omni/distributed/persistent_fsdp.py",
            *_under("tests/distributed", "fsdp_ranks.py", "test_persistent_fsdp.py"),
        ),
    ),
    Patch(
        "the kinds a diffusion module calls beyond the coordinator's, staged",
        (
            "vllm_omni/distributed/module_collectives.py",
            *_under("tests/distributed", "contract_ranks.py", "module_ranks.py", "test_module_collectives.py"),
        ),
    ),
    Patch(
        "the rule: every diffusion module's collectives through managed_distributed",
        (
            "vllm_omni/distributed/managed_distributed.py",
            *_under(
                "tests/distributed",
                "managed_ranks.py",
                "pool_ranks.py",
                "sequence_parallel_ranks.py",
                "test_managed_distributed.py",
                "test_sequence_parallel.py",
            ),
        ),
        # It edits the coordinator's own calls again: the coordinator's eager tests, one start of the ranks.
        retests=tuple(
            f"tests/distributed/test_group_coordinator.py::test_{name}"
            for name in (
                "every_collective_of_the_coordinator_gives_the_plain_bits_with_persistent_buffers",
                "with_persistent_buffers_the_coordinator_hands_the_backend_only_blocks",
                "a_collective_on_the_coordinators_gloo_group_is_control_and_keeps_no_block",
                "bad_arguments_raise_on_every_rank_before_any_collective_naming_the_value",
            )
        ),
    ),
)
OWNED = tuple(path for patch in SERIES for path in patch.owns)
# This project's CPU test platform (tests/cpu_platform): its plugins and the variable that turns it on.
TEST_PLATFORM = ("cpu_test", "cpu_test_workarounds")
TEST_PLATFORM_ENV = "VLLM_OMNI_CPU_TEST_PLATFORM"
# Run from this checkout against the whole series: they need the project's synthetic pipelines.
CHECKOUT_TESTS = ("tests/e2e/test_minimax_h3_serve_cpu.py", "tests/e2e/test_wan2_2_serve_cpu.py")
# This checkout's own tests of what only Inductor does, on gloo ranks: run once, on the whole series, plugin and CPU
# test platform off, as the patches' own tests run (those compile with aot_eager).
INDUCTOR_TESTS = ("tests/distributed/test_inductor_on_ranks.py",)
# The tree has no pytest configuration of its own: upstream's markers (its pyproject.toml) that the tests use.
PYTEST_INI = """[pytest]
addopts = --strict-markers -q -p no:cacheprovider
markers =
    core_model: L1&L2 tests (run in each PR)
    diffusion: Diffusion model tests
    parallel: Parallelism/distributed tests
    cpu: Tests that run on CPU
"""
_IDENTITY = {
    "GIT_AUTHOR_NAME": "vLLM-Omni contributors",
    "GIT_AUTHOR_EMAIL": "contributors@vllm-omni.invalid",
    "GIT_COMMITTER_NAME": "vLLM-Omni contributors",
    "GIT_COMMITTER_EMAIL": "contributors@vllm-omni.invalid",
    "GIT_AUTHOR_DATE": "2026-12-03T00:00:00Z",
    "GIT_COMMITTER_DATE": "2026-12-03T00:00:00Z",
    "GIT_CONFIG_GLOBAL": os.devnull,  # the patches' bytes must not depend on whoever writes them
    "GIT_CONFIG_NOSYSTEM": "1",
}


def _git(tree: Path, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | _IDENTITY
    return subprocess.run(["git", *args], cwd=tree, env=env, capture_output=True, text=True)


def _git_ok(tree: Path, *args: str) -> str:
    done = _git(tree, *args)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed in {tree}:\n{done.stderr}")
    return done.stdout


def patch_files() -> list[Path]:
    patches = sorted(PATCHES.glob("*.patch"))
    if len(patches) != len(SERIES):
        raise SystemExit(f"{PATCHES} has {len(patches)} *.patch files; SERIES names {len(SERIES)} patches")
    return patches


@functools.cache
def _wheel() -> Path:
    """The 0.30.0 wheel, downloaded once per process."""
    download = Path(tempfile.mkdtemp(prefix="vllm-omni-wheel-"))
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"vllm-omni=={RELEASE}", "-d", str(download)]
    subprocess.run(command, check=True, capture_output=True)
    (wheel,) = download.glob("vllm_omni-*.whl")
    return wheel


@functools.cache
def _pristine_template() -> Path:
    """The pristine tree, built once per process (extracting and committing some 4,000 files takes seconds)."""
    template = Path(tempfile.mkdtemp(prefix="vllm-omni-pristine-"))
    atexit.register(shutil.rmtree, template, ignore_errors=True)
    with zipfile.ZipFile(_wheel()) as archive:
        archive.extractall(template, [n for n in archive.namelist() if n.startswith("vllm_omni/")])
    shutil.copytree(UPSTREAM_TESTS, template, dirs_exist_ok=True)
    _git_ok(template, "init", "-q")
    _git_ok(template, "add", "-A")
    _git_ok(template, "commit", "-q", "-m", f"vLLM-Omni {RELEASE} package tree, from the wheel, with upstream's tests")
    return template


def pristine_tree(dest: Path) -> Path:
    """The 0.30.0 wheel's ``vllm_omni`` package and upstream's test files the series changes (``UPSTREAM_TESTS``) in
    a fresh git repository at ``dest``, one commit."""
    shutil.copytree(_pristine_template(), dest, symlinks=True, dirs_exist_ok=True)
    _git_ok(dest, "update-index", "-q", "--refresh")  # the copies' inodes and ctimes are not the index's
    return dest


def apply_patches(tree: Path, patches: list[Path]) -> None:
    """``git apply --check`` then ``git am`` each patch in order, a commit with its message each (so the tree is a
    source for ``regenerate --tree``); a patch that no longer applies stops here, with git's own lines naming the
    file and the hunk."""
    for patch in patches:
        checked = _git(tree, "apply", "--check", "-v", str(patch))
        if checked.returncode != 0:
            failed = "\n".join(line for line in checked.stderr.splitlines() if line.startswith("error"))
            raise SystemExit(f"{patch.name} no longer applies to vLLM-Omni {RELEASE}:\n{failed}")
        _git_ok(tree, "am", "-q", "--keep-non-patch", str(patch))


def regenerate(source: Path | None = None, out: Path = PATCHES) -> list[Path]:
    """Rewrite every patch into ``out``. Each commit of ``source`` after its first (default: the current patches
    applied with ``git am``) gives a patch's message and its edits to release files; the files the patch owns come
    from this checkout, and a new file it does not own is dropped."""
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "series"
        if source is None:
            apply_patches(pristine_tree(tree), patch_files())
        else:
            _git_ok(Path(scratch), "clone", "-q", str(source.resolve()), str(tree))
        commits = _git_ok(tree, "rev-list", "--reverse", "HEAD").split()[1:]
        if len(commits) != len(SERIES):
            raise SystemExit(f"{source or PATCHES}: {len(commits)} patches; SERIES names {len(SERIES)}")
        missing = [relative for relative in OWNED if not (ROOT / relative).is_file()]
        if missing:
            raise SystemExit(f"SERIES names files this checkout does not have: {missing}")
        _git_ok(tree, "checkout", "-q", "--detach", f"{commits[0]}~1")
        for number, (commit, patch) in enumerate(zip(commits, SERIES, strict=True), start=1):
            touched = _git_ok(tree, "diff", "--no-renames", "--name-only", f"{commit}~1", commit).split()
            others = sorted(set(touched) & set(OWNED) - set(patch.owns))
            if others:
                raise SystemExit(f"patch {number} touches files another patch owns: {others}")
            _git_ok(tree, "cherry-pick", "--allow-empty", commit)
            added = _git_ok(tree, "diff", "--no-renames", "--name-only", "--diff-filter=A", "HEAD~1", "HEAD").split()
            for stray in sorted(set(added) - set(patch.owns)):
                print(f"[upstream] patch {number}: {stray} is new and SERIES gives it no owner: dropped")
                _git_ok(tree, "rm", "-q", stray)
            for relative in patch.owns:
                (tree / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(ROOT / relative, tree / relative)
            _git_ok(tree, "add", "-A")
            _git_ok(tree, "commit", "-q", "--amend", "--no-edit", "--allow-empty")
        for old in out.glob("*.patch"):
            old.unlink()
        since = f"HEAD~{len(SERIES)}"
        written = _git_ok(
            tree, "format-patch", "-N", "--no-renames", "--no-signature", "--zero-commit", "-o", str(out), since
        )
        return [Path(line) for line in written.splitlines()]


def plugins_without_ours(*, test_platform: bool = True) -> str:
    """``VLLM_PLUGINS`` that loads every installed plugin but this project's fix (and, with ``test_platform=False``,
    but its CPU test platform too)."""
    groups = (
        "vllm.general_plugins",
        "vllm.platform_plugins",
        "vllm_omni.general_plugins",
        "vllm_omni.platform_plugins",
    )
    ours = {PLUGIN, *(old for old, new in ENTRY_POINTS.items() if new == PLUGIN)}
    if not test_platform:
        ours |= set(TEST_PLATFORM)
    names = {ep.name for group in groups for ep in entry_points(group=group)} - ours
    return ",".join(sorted(names))


def _tree_env(tree: Path, *, test_platform: bool) -> dict[str, str]:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "VLLM_PLUGINS": plugins_without_ours(test_platform=test_platform),
        TREE_ENV: str(tree),
    }
    # The test platform's import stand-ins stay on either way: PyPI has no torchvision or torchaudio that loads
    # beside torch 2.13.0+cpu, and the worker's module imports both (vllm_omni_cpu_test_platform.startup).
    env[TEST_PLATFORM_ENV] = "1"
    return env


def prefix_tree(dest: Path, length: int) -> Path:
    """The pristine tree with the first ``length`` patches applied."""
    apply_patches(pristine_tree(dest), patch_files()[:length])
    return dest


def run_patch_tests(tree: Path, index: int, *pytest_args: str) -> int:
    """Patch ``index``'s own tests (0-based) in ``tree``, with that tree first, the plugin and the CPU test platform
    off: what upstream runs them with."""
    (tree / "pytest.ini").write_text(PYTEST_INI)
    targets = SERIES[index].tests
    print(f"[upstream] patch {index + 1}: pytest {' '.join(targets)} in {tree}", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "pytest", *pytest_args, *targets]
    return subprocess.run(command, cwd=tree, env=_tree_env(tree, test_platform=False)).returncode


def run_checkout_tests(tree: Path, tests: tuple[str, ...] = CHECKOUT_TESTS) -> int:
    """Tests of this checkout against the whole series' ``tree``, plugin off: the serve tests through the CPU test
    platform (they serve on CPU ranks), ``INDUCTOR_TESTS`` without it."""
    print(f"[upstream] pytest {' '.join(tests)} against {tree}", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "pytest", *tests]
    env = _tree_env(tree, test_platform=tests == CHECKOUT_TESTS)
    return subprocess.run(command, cwd=ROOT, env=env).returncode


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tooling.upstream_patches",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=f"Needs: the vllm-omni {RELEASE} wheel's venv (.venv-omni-0.30). Exit status: 0 when the patches apply "
        "(and with test, their tests pass), pytest's status when they fail, 1 when a patch does not apply, 2 on a bad "
        "argument.",
    )
    parser.add_argument("action", choices=("check", "test", "regenerate"), help="what to do")
    parser.add_argument("--tree", type=Path, help="check/test: where to lay the patched tree (new or empty), a "
                        "temporary directory if not; regenerate: a git tree whose commits after the first are the "
                        "series, the patches themselves if not")  # fmt: skip
    parser.add_argument(
        "--prefix", type=int, help=f"check/test: the first N patches only (1 to {len(SERIES)}); all if not"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    tree_arg = args.tree.resolve() if args.tree is not None else None
    if args.action == "regenerate":
        if args.prefix is not None:
            parser.error("--prefix: regenerate always writes the whole series")
        _doc_parts()  # the doc's markers, before any patch is rewritten
        for written in regenerate(tree_arg):
            print(f"[upstream] wrote {written.relative_to(ROOT)}")
        write_series_doc()
        print(f"[upstream] wrote the series' section of {DOC.relative_to(ROOT)}")
        return 0
    prefixes = [args.prefix] if args.prefix is not None else list(range(1, len(SERIES) + 1))
    if not all(1 <= length <= len(SERIES) for length in prefixes):
        parser.error(f"--prefix={args.prefix}: expected 1 to {len(SERIES)}")
    base = tree_arg or Path(tempfile.mkdtemp(prefix=f"vllm-omni-{RELEASE}-patched-"))
    if base.exists() and (not base.is_dir() or any(base.iterdir())):
        parser.error(f"--tree={base}: expected a new or empty directory")
    for length in prefixes:
        tree = prefix_tree(base / f"prefix-{length}", length)
        print(f"[upstream] patches 1-{length} apply to vLLM-Omni {RELEASE}: {tree}")
        if args.action == "test" and (failed := run_patch_tests(tree, length - 1)):
            return failed
    if args.action == "test" and args.prefix is None:  # the whole series: serve it, and Inductor on ranks
        whole = base / f"prefix-{len(SERIES)}"
        return run_checkout_tests(whole) or run_checkout_tests(whole, INDUCTOR_TESTS)
    return 0


def _diff_lines(patch: Path):
    """``(file, line)`` for each line of the patch's hunks (after its message and each file's header)."""
    current, in_hunk = None, False
    for line in patch.read_text().split("\n"):
        if line.startswith("diff --git "):
            current, in_hunk = line.split(" b/", 1)[-1], False
        elif current is not None and line.startswith("@@"):
            in_hunk = True
        elif in_hunk and line[:1] in ("+", "-", " "):
            yield current, line
        elif in_hunk:
            in_hunk = line.startswith("\\")  # "\ No newline at end of file" stays in the hunk
    return


def added_lines(patch: Path) -> dict[str, list[str]]:
    """Per file, the lines ``patch`` adds; under ``-<file>``, the lines it removes."""
    lines: dict[str, list[str]] = {}
    for current, line in _diff_lines(patch):
        if line[0] == "+":
            lines.setdefault(current, []).append(line[1:])
        elif line[0] == "-":
            lines.setdefault(f"-{current}", []).append(line[1:])
    return lines


def added_non_test_lines(patch: Path) -> int:
    """What a reviewer reads beside the tests: the patch's added non-blank lines outside ``tests/``."""
    lines = added_lines(patch).items()
    return sum(1 for key, added in lines if not key.startswith(("-", "tests/")) for line in added if line.strip())


def message(patch: Path) -> str:
    """The patch's commit message (its pull request's description)."""
    text = patch.read_text()
    return re.split(r"\n---\n", text.split("\n\n", 1)[1], maxsplit=1)[0]


def subject(patch: Path) -> str:
    """The patch's title, as a pull request's."""
    found = re.search(r"^Subject: \[PATCH[^\]]*\] (.*(?:\n .*)*)$", patch.read_text(), re.M)
    if found is None:
        raise SystemExit(f"{patch.name}: no Subject line")
    return " ".join(found.group(1).split())


def _files(patch: Path) -> list[tuple[str, int, int, bool]]:
    """Each file the patch touches, in its order: lines added, lines removed, whether the patch creates it."""
    rows: dict[str, list] = {}
    for line in patch.read_text().split("\n"):
        if line.startswith("diff --git "):
            rows[line.split(" b/", 1)[-1]] = [0, 0, False]
        elif line.startswith("new file mode") and rows:
            rows[next(reversed(rows))][2] = True
    for current, line in _diff_lines(patch):
        if line[0] in "+-":
            rows[current]["+-".index(line[0])] += 1
    return [(name, added, removed, new) for name, (added, removed, new) in rows.items()]


def series_section(patches: list[Path]) -> str:
    """The series as ``DOC`` lists it: per patch in review order, its title, size, tests and files."""
    parts = [DOC_BEGIN]
    for number, (patch, spec) in enumerate(zip(patches, SERIES, strict=True), start=1):
        parts += [
            f"### {number}. {subject(patch)}",
            "",
            f"`patches/{patch.name}`: {added_non_test_lines(patch)} added non-test lines; {spec.topic}. Its "
            f"tests, on patches 1-{number}: `python -m tooling.upstream_patches test --prefix {number}` "
            f"(`pytest {' '.join(spec.tests)}`).",
            "",
            "| file | added | removed |",
            "| --- | --- | --- |",
            *(f"| `{name}`{' (new)' * new} | {added} | {removed} |" for name, added, removed, new in _files(patch)),
            "",
        ]
    return "\n".join([*parts, DOC_END])


def _doc_parts() -> tuple[str, str]:
    """What of ``DOC`` comes before the series' section and after it; exits where its markers are not as expected."""
    text = DOC.read_text()
    if text.count(DOC_BEGIN) != 1 or text.count(DOC_END) != 1 or text.index(DOC_BEGIN) > text.index(DOC_END):
        raise SystemExit(f"{DOC}: expected one {DOC_BEGIN!r}, then one {DOC_END!r}")
    before, rest = text.split(DOC_BEGIN)
    return before, rest.split(DOC_END)[1]


def write_series_doc() -> None:
    before, after = _doc_parts()
    DOC.write_text(before + series_section(patch_files()) + after)


if __name__ == "__main__":
    sys.exit(main())
