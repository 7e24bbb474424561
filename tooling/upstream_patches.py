# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The upstream change as ``git format-patch`` files against the released vLLM-Omni 0.30.0 package tree.

vLLM-Omni publishes no sdist after 0.20.0, so the reference is the 0.30.0 wheel's ``vllm_omni`` tree, fetched
fresh (the installed copy carries this project's overlay). Run from the 0.30.0 environment:

    python -m tooling.upstream_patches check        # pristine tree, git apply --check, git apply
    python -m tooling.upstream_patches test         # check, then the patch's tests and the serve test
                                                             # against the patched tree, with the plugin off
    python -m tooling.upstream_patches regenerate   # rewrite patches/ from this checkout's files
    python -m tooling.upstream_patches regenerate --new MESSAGE_FILE   # the change as a patch of its own
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import entry_points
from pathlib import Path

from xpu_collective_memory.renamed import ENTRY_POINTS, PLUGIN

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches"
RELEASE = "0.30.0"
TREE_ENV = "VLLM_OMNI_TEST_UPSTREAM_TREE"  # the test suite then runs that tree's code, not this checkout's
# What the patches carry from this checkout, beside their hand-made changes (vae.py in the first; the coordinator,
# the platform interface and the request path's imports in the second; the third only carries; every diffusion
# module's import of managed_distributed in the fourth; the worker's and HSDP's in the fifth; the worker's pool in
# the seventh). ``regenerate``
# refreshes the last patch: a file the last patch carries is as this checkout has it once every patch is applied;
# the earlier patches' copies are their own (the first's vae_gather.py has no request-path scoping yet, the
# second's persistent collectives predate the third's cost and contract changes).
CARRIED_FIRST = (
    "vllm_omni/diffusion/models/minimax_h3/vae_gather.py",
    "vllm_omni/distributed/collective_workspaces.py",
    *(
        f"tests/diffusion/models/minimax_h3/{name}"
        for name in (
            "__init__.py",
            "conftest.py",
            "fake_collective.py",
            "stand_ins.py",
            "bad_input_cases.py",
            "test_vae_gather.py",
            "test_vae_gather_bad_input.py",
        )
    ),
)
CARRIED_LAST = (
    "vllm_omni/distributed/collective_workspaces.py",
    "vllm_omni/distributed/persistent_collectives.py",
    "vllm_omni/distributed/managed_distributed.py",
    "vllm_omni/distributed/traced_collectives.py",
    "vllm_omni/distributed/persistent_fsdp.py",
    "vllm_omni/distributed/request_pool.py",
    "vllm_omni/diffusion/models/minimax_h3/vae_gather.py",
    *(
        f"tests/distributed/{name}"
        for name in (
            "__init__.py",
            "ranks.py",
            "collective_ranks.py",
            "coordinator_ranks.py",
            "sequence_parallel_ranks.py",
            "contract_ranks.py",
            "managed_ranks.py",
            "fsdp_ranks.py",
            "order_ranks.py",
            "test_persistent_collectives.py",
            "test_group_coordinator.py",
            "test_sequence_parallel.py",
            "test_managed_distributed.py",
            "test_persistent_fsdp.py",
            "test_program_order.py",
            "mem_pool_stand_in.py",
            "pool_ranks.py",
            "test_request_pool.py",
        )
    ),
)
CARRIED = tuple(dict.fromkeys(CARRIED_FIRST + CARRIED_LAST))
# The gather's unit tests and the patches' tests that run release modules as the patches change them: the
# coordinator, the sequence-parallel attention. The tests of the layer the patches carry whole (persistent
# collectives, managed_distributed, FSDP2's all-gather) run once, on this checkout in the 0.28.0 pass, under the same
# torch: ``test_the_patch_carries_this_checkouts_file_as_it_is_now`` holds the files identical.
UPSTREAM_TESTS = (
    "tests/diffusion/models/minimax_h3",
    "tests/distributed/test_group_coordinator.py",
    "tests/distributed/test_sequence_parallel.py",
)
# Run from this checkout against the patched tree: the serve test needs the project's synthetic pipeline.
CHECKOUT_TESTS = ("tests/e2e/test_minimax_h3_serve_cpu.py", "tests/e2e/test_wan2_2_serve_cpu.py")
# The tree has no pytest configuration of its own; upstream's registers these markers.
PYTEST_INI = """[pytest]
addopts = --strict-markers -q -p no:cacheprovider
markers =
    core_model: core functionality tests
    cpu: runs on CPU only
    diffusion: diffusion model tests
    distributed: starts several torch.distributed ranks
"""
_IDENTITY = {
    "GIT_AUTHOR_NAME": "vLLM-Omni contributors",
    "GIT_AUTHOR_EMAIL": "contributors@vllm-omni.invalid",
    "GIT_COMMITTER_NAME": "vLLM-Omni contributors",
    "GIT_COMMITTER_EMAIL": "contributors@vllm-omni.invalid",
    "GIT_AUTHOR_DATE": "2026-12-03T00:00:00Z",
    "GIT_COMMITTER_DATE": "2026-12-03T00:00:00Z",
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
    if not patches:
        raise SystemExit(f"no *.patch files in {PATCHES}")
    return patches


def pristine_tree(dest: Path) -> Path:
    """The 0.30.0 wheel's ``vllm_omni`` package in a fresh git repository at ``dest``, one commit."""
    with tempfile.TemporaryDirectory() as download:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"vllm-omni=={RELEASE}", "-d", download]
        subprocess.run(command, check=True, capture_output=True)
        (wheel,) = Path(download).glob("vllm_omni-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(dest, [n for n in archive.namelist() if n.startswith("vllm_omni/")])
    _git_ok(dest, "init", "-q")
    _git_ok(dest, "add", "-A")
    _git_ok(dest, "commit", "-q", "-m", f"vLLM-Omni {RELEASE} package tree, from the wheel")
    return dest


def apply_patches(tree: Path, patches: list[Path]) -> None:
    """``git apply --check`` then ``git apply`` each patch in order; a patch that no longer applies stops here,
    with git's own lines naming the file and the hunk."""
    for patch in patches:
        checked = _git(tree, "apply", "--check", "-v", str(patch))
        if checked.returncode != 0:
            failed = "\n".join(line for line in checked.stderr.splitlines() if line.startswith("error"))
            raise SystemExit(f"{patch.name} no longer applies to vLLM-Omni {RELEASE}:\n{failed}")
        _git_ok(tree, "apply", "--index", str(patch))
        _git_ok(tree, "commit", "-q", "-m", f"apply {patch.name}")


def regenerate(patches: list[Path], message: Path | None = None) -> list[Path]:
    """Re-apply the patches as commits, refresh what the last one carries from this checkout (or, with a
    ``message``, carry the change in a new patch of its own with that message), write them out."""
    with tempfile.TemporaryDirectory() as scratch:
        tree = pristine_tree(Path(scratch))
        _git_ok(tree, "am", "-q", "--keep-non-patch", *map(str, patches))
        for relative in CARRIED_LAST:
            target = tree / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / relative, target)
        _git_ok(tree, "add", "-A")
        if _git(tree, "diff", "--cached", "--quiet").returncode != 0:
            how = ["--amend", "--no-edit"] if message is None else ["-F", str(message.resolve())]
            _git_ok(tree, "commit", "-q", *how)
        for old in patches:
            old.unlink()
        since = f"HEAD~{len(patches) + (message is not None)}"
        out = _git_ok(tree, "format-patch", "-q", "-N", "--no-signature", "--zero-commit", "-o", str(PATCHES), since)
        return [Path(line) for line in out.splitlines()]


def plugins_without_ours() -> str:
    """``VLLM_PLUGINS`` that loads every installed plugin but this project's fix."""
    groups = (
        "vllm.general_plugins",
        "vllm.platform_plugins",
        "vllm_omni.general_plugins",
        "vllm_omni.platform_plugins",
    )
    ours = {PLUGIN, *(old for old, new in ENTRY_POINTS.items() if new == PLUGIN)}
    names = {ep.name for group in groups for ep in entry_points(group=group)} - ours
    return ",".join(sorted(names))


def run_against(tree: Path) -> int:
    """The patches' own tests in the patched tree, then the serve test from this checkout, with that tree first and
    the plugin off."""
    (tree / "pytest.ini").write_text(PYTEST_INI)
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "VLLM_PLUGINS": plugins_without_ours(),
        TREE_ENV: str(tree),
    }
    for cwd, targets in ((tree, UPSTREAM_TESTS), (ROOT, CHECKOUT_TESTS)):
        print(f"[upstream] pytest {' '.join(targets)} against {tree}", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, "-m", "pytest", *targets], cwd=cwd, env=env)
        if done.returncode != 0:
            return done.returncode
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("check", "test", "regenerate"))
    parser.add_argument("--tree", type=Path, help="where to lay the patched tree (default: a new temporary directory)")
    parser.add_argument("--new", type=Path, metavar="MESSAGE_FILE", help="regenerate: a new last patch, this message")
    args = parser.parse_args(argv)
    patches = patch_files()
    if args.action == "regenerate":
        for written in regenerate(patches, args.new):
            print(f"[upstream] wrote {written.relative_to(ROOT)}")
        return 0
    tree = args.tree or Path(tempfile.mkdtemp(prefix="vllm-omni-0.30.0-patched-"))
    if tree.exists() and any(tree.iterdir()):
        parser.error(f"--tree={tree}: expected a new or empty directory")
    apply_patches(pristine_tree(tree), patches)
    print(f"[upstream] {len(patches)} patch(es) apply to vLLM-Omni {RELEASE}: {tree}")
    return run_against(tree) if args.action == "test" else 0


if __name__ == "__main__":
    sys.exit(main())
