# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The upstream series against a pristine vLLM-Omni 0.30.0 package tree, fetched from the package index.

Each prefix must apply and pass its last patch's own tests there, with this project's plugin off, and those tests
must fail on the prefix before it; the whole series must serve and leave no collective site unrouted. The series
must read as one change: no patch rewrites what an earlier one added, each owns its new files whole as this
checkout has them, nothing it carries imports this project, and ``regenerate`` gives back the same patches.
"""

from __future__ import annotations

import ast
import re
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.utils import REPO_ROOT
from tooling import upstream_patches
from tooling.upstream_patches import SERIES, added_lines, message
from xpu_collective_memory import reach

pytestmark = [
    pytest.mark.advanced_model,
    pytest.mark.cpu,
    pytest.mark.diffusion,
    pytest.mark.integration,
    pytest.mark.skipif(
        version("vllm-omni") != upstream_patches.RELEASE,
        reason=f"the patches are made against vLLM-Omni {upstream_patches.RELEASE}",
    ),
]

ADAPTER = "vllm_omni/diffusion/models/minimax_h3/vae.py"
WORKER = "vllm_omni/diffusion/worker/diffusion_worker.py"
COORDINATOR = "vllm_omni/diffusion/distributed/group_coordinator.py"
HSDP = "vllm_omni/diffusion/distributed/hsdp.py"
PATCHES = upstream_patches.patch_files()
PREFIXES = [pytest.param(length, id=f"{length:04d}") for length in range(1, len(SERIES) + 1)]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return upstream_patches.prefix_tree(tmp_path_factory.mktemp("whole"), len(SERIES))


def test_the_series_is_seven_patches_gather_pool_eager_compiled_fsdp_kinds_rule_in_review_order():
    subjects = [re.search(r"^Subject: \[PATCH[^\]]*\] (.*)$", p.read_text(), re.M).group(1) for p in PATCHES]
    expected = ("[MiniMax-H3] Keep the VAE tile gather", "[XPU] Each diffusion request in one", "[XPU] Staged collect",
                "[XPU] The coordinator's staged collectives compiled", "[XPU] FSDP2's parameter all-gather",
                "[XPU] The kinds a diffusion module calls", "[XPU] Every diffusion module")  # fmt: skip
    assert all(e in s for e, s in zip(expected, subjects, strict=True)), subjects


@pytest.mark.parametrize("length", PREFIXES)
def test_each_prefix_applies_to_the_pristine_tree_and_passes_its_last_patchs_own_tests(tmp_path, length):
    tree = upstream_patches.prefix_tree(tmp_path / "tree", length)
    assert upstream_patches.run_patch_tests(tree, length - 1) == 0


def _new_modules(patch) -> set[str]:
    """The ``vllm_omni`` modules a patch adds, by their import names."""
    return {name[:-3].replace("/", ".") for name, *_ in upstream_patches._files(patch) if name.endswith(".py")
            and name.startswith("vllm_omni/") and name in SERIES[PATCHES.index(patch)].owns}  # fmt: skip


def _imported(relative: str) -> set[str]:
    tree = ast.parse((REPO_ROOT / relative).read_text())
    found = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    found |= {f"{node.module}.{alias.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
              for alias in node.names if node.module}  # fmt: skip
    return found | {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}


@pytest.mark.parametrize("length", PREFIXES)
def test_each_patch_adds_a_module_its_tests_import_so_they_fail_on_the_prefix_before_it(length):
    patch, spec = PATCHES[length - 1], SERIES[length - 1]
    assert _new_modules(patch), patch.name  # each code path comes with the patch that tests it
    tests = [relative for relative in spec.owns if relative.startswith("tests/") and relative.endswith(".py")]
    for test in (relative for relative in tests if Path(relative).name.startswith("test_")):
        helpers = {r for r in tests if r[:-3].replace("/", ".") in _imported(test)}  # each test file, or its helper
        assert _new_modules(patch) & set().union(*map(_imported, {test, *helpers})), test


def test_the_whole_series_serves_minimax_h3_and_wan2_2_with_the_plugin_off(whole):
    assert upstream_patches.run_checkout_tests(whole) == 0


def test_on_the_whole_series_inductor_keeps_every_staged_collective_whole_staged_and_in_program_order(whole):
    assert upstream_patches.run_checkout_tests(whole, upstream_patches.INDUCTOR_TESTS) == 0


def test_every_collective_site_of_the_patched_tree_is_routed_or_reviewed_without_the_plugin(whole, capsys):
    assert reach.main(["--tree", str(whole / "vllm_omni" / "diffusion"), "--without-plugin"]) == 0, (
        capsys.readouterr().err
    )


def test_the_adapter_installs_the_gather_and_scopes_its_remote_code_and_keeps_none_of_its_override(whole):
    adapter = (whole / ADAPTER).read_text()
    assert "from .vae_gather import install_tile_gather_reuse\n" in adapter
    assert adapter.count("install_tile_gather_reuse(self)") == adapter.count("scope_remote_code(self.model)") == 1
    for removed in ("_persistent_tile_gather", "_tile_gather_workspace", "_tile_gather_reuse_enabled"):
        assert removed not in adapter


def test_the_coordinator_keeps_its_methods_which_stage_only_where_the_process_does_and_registers_every_instance(
    whole,
):
    coordinator = (whole / COORDINATOR).read_text()
    for name in ("all_reduce", "all_gather", "broadcast"):
        method = coordinator[coordinator.index(f"    def {name}(") :]
        method = method[: method.index("\n    def ", 1)]
        guard = "        if request_collectives.staging():  # persistent buffers (XPU)\n"
        compiled = "            if torch.compiler.is_compiling():  # through registered ops, in one graph\n"
        compiled += f"                return traced.coordinator_{name}(self, "
        assert (
            guard in method and compiled in method and f"return request_collectives.coordinator_{name}(self, " in method
        )
        assert f"dist.{'all_gather_into_tensor' if name == 'all_gather' else name}(" in method  # upstream's call
    # GroupCoordinator's and PipelineGroupCoordinator's own __init__ (the latter calls no super().__init__)
    assert coordinator.count("persistent_collectives.register_coordinator(self)") == 2


def _imports(tree: Path, path: Path) -> set[str]:
    """The ``vllm_omni`` modules ``path`` imports, at its top or inside a function alike."""
    package = ".".join(path.relative_to(tree).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *filter(None, [node.module])])
            found |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
    return {name for name in found if name.startswith("vllm_omni")}


def _import_graph(tree: Path) -> dict[str, set[str]]:
    modules = {
        ".".join(p.relative_to(tree).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (tree / "vllm_omni").rglob("*.py")
    }
    return {name: {m for m in _imports(tree, path) if m in modules and m != name} for name, path in modules.items()}


def test_no_import_the_series_adds_closes_a_cycle(whole, tmp_path):
    """Upstream has cycles of its own (``forward_context`` and the attention layers); none may go through an import
    the series adds, at a module's top or inside a function."""
    graph, released = _import_graph(whole), _import_graph(upstream_patches.pristine_tree(tmp_path / "released"))
    added = sorted((a, b) for a, targets in graph.items() for b in targets - released.get(a, set()))

    def reaches(start: str, goal: str) -> bool:
        seen, stack = {start}, [start]
        while stack:
            for nxt in graph[stack.pop()] - seen:
                if nxt == goal:
                    return True
                seen.add(nxt)
                stack.append(nxt)
        return start == goal

    assert len(added) > 40
    assert [f"{a} -> {b}" for a, b in added if reaches(b, a)] == []


def test_hsdp_shards_with_the_persistent_fully_shard(whole):
    assert "from vllm_omni.distributed.persistent_fsdp import fully_shard" in (whole / HSDP).read_text()


def test_the_worker_keeps_its_pool_from_init_device_to_sleep_and_starts_and_loads_with_plain_collectives(whole):
    worker = (whole / WORKER).read_text()
    init_device = worker[
        worker.index("    def init_device(") : worker.index("create_diffusion_vllm_config(self.device")
    ]
    assert "self.request_pool = open_request_pool(current_omni_platform, self.device)" in init_device
    assert init_device.index("set_device(self.device)") < init_device.index("open_request_pool")
    assert worker.count("use_request_pool(self.request_pool)") == 3  # execute_model, _batch, execute_stepwise
    sleep = worker[worker.index("    def sleep(") : worker.index("    def wake_up(")]
    assert sleep.index("self.request_pool.release()") < sleep.index("current_omni_platform.empty_cache()")
    assert worker.count("unstaged()") == 2  # around init_device, inside load_model
    assert "install_persistent_collectives" not in worker


def test_no_patch_removes_or_rewrites_a_line_an_earlier_patch_added():
    added_before: dict[str, set[str]] = {}
    for patch in PATCHES:
        lines = added_lines(patch)
        for key, removed in lines.items():
            if key.startswith("-"):
                rewritten = {line for line in removed if line.strip()} & added_before.get(key[1:], set())
                assert not rewritten, f"{patch.name} rewrites {key[1:]}: {sorted(rewritten)[:3]}"
        for key, added in lines.items():
            if not key.startswith("-"):
                added_before.setdefault(key, set()).update(added)


@pytest.mark.parametrize("relative", upstream_patches.OWNED)
def test_each_owned_file_is_added_by_its_patch_alone_as_this_checkout_has_it(whole, relative):
    # A change here that is not in the patch: python -m tooling.upstream_patches regenerate
    touching = [patch.name for patch in PATCHES if f"diff --git a/{relative} b/{relative}\n" in patch.read_text()]
    owner = next(p for p, spec in zip(PATCHES, SERIES, strict=True) if relative in spec.owns)
    assert touching == [owner.name] and "new file mode" in owner.read_text().split(f"b/{relative}\n", 1)[1][:40]
    assert (whole / relative).read_bytes() == (REPO_ROOT / relative).read_bytes(), relative


# What upstream does not have: this project's packages, its plugin, its test platform and diagnostics.
OWN = re.compile(
    r"xpu_collective_memory|\btooling\b|\bbenchmarks\b|cpu_test|CPU test platform|plugin|census|reach check", re.I
)


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name[:4])
def test_nothing_a_patch_carries_or_says_names_this_projects_own_packages_or_tools(patch):
    said = [message(patch), *(line for key, lines in added_lines(patch).items() if key[0] != "-" for line in lines)]
    assert not [line for text in said for line in text.splitlines() if OWN.search(line)]


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name[:4])
def test_each_patch_adds_at_most_400_non_test_lines_or_its_message_says_why(patch):
    count = upstream_patches.added_non_test_lines(patch)
    assert count > 0
    assert count <= upstream_patches.MAX_ADDED or f"## {upstream_patches.LARGER_HEADING}" in message(patch), count


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name[:4])
def test_each_message_is_a_pull_request_description_with_its_test_plan_and_what_a_card_must_check(patch):
    text = message(patch)
    for heading in ("## Purpose", "## Test Plan", "## Test Result"):
        assert heading in text, (patch.name, heading)
    assert "What a card must check" in text and "pytest tests/" in text


def test_the_docs_section_on_the_series_is_written_from_the_patches():
    # Stale: python -m tooling.upstream_patches regenerate
    assert upstream_patches.series_section(PATCHES) in upstream_patches.DOC.read_text()


def test_regenerate_gives_back_the_series_byte_for_byte(tmp_path):
    written = upstream_patches.regenerate(out=tmp_path)
    assert [p.name for p in written] == [p.name for p in PATCHES]
    assert all(new.read_bytes() == old.read_bytes() for new, old in zip(written, PATCHES, strict=True))


def test_regenerate_from_a_laid_out_tree_gives_back_the_series_and_refuses_a_commit_touching_anothers_file(tmp_path):
    tree = upstream_patches.prefix_tree(tmp_path / "tree", len(SERIES))
    written = upstream_patches.regenerate(tree, out=tmp_path / "out")
    assert all(new.read_bytes() == old.read_bytes() for new, old in zip(written, PATCHES, strict=True))
    owned_by_the_first = SERIES[0].owns[0]
    (tree / owned_by_the_first).write_text("# edited by the last patch\n")
    upstream_patches._git_ok(tree, "commit", "-q", "-a", "--amend", "--no-edit")
    refused = rf"patch {len(SERIES)} touches files another patch owns: .*{owned_by_the_first}"
    with pytest.raises(SystemExit, match=refused):
        upstream_patches.regenerate(tree, out=tmp_path / "again")


def test_the_docs_section_is_refused_without_its_markers_before_any_patch_is_rewritten(tmp_path, monkeypatch):
    doc = tmp_path / "upstream_pr.md"
    doc.write_text(f"{upstream_patches.DOC_END}\n{upstream_patches.DOC_BEGIN}\n")
    monkeypatch.setattr(upstream_patches, "DOC", doc)
    monkeypatch.setattr(upstream_patches, "regenerate", lambda *args, **kwargs: pytest.fail("patches rewritten"))
    with pytest.raises(SystemExit, match="expected one"):
        upstream_patches.main(["regenerate"])


def test_a_patch_that_no_longer_applies_names_the_file_and_the_hunk(tmp_path):
    patch = PATCHES[0]
    text = patch.read_text()
    context = "\n         self.device_module = torch.get_device_module()\n"  # a context line of the vae.py hunk
    assert context in text
    broken = tmp_path / patch.name
    broken.write_text(text.replace(context, context.replace("device_module =", "device_module_moved =")))
    tree = upstream_patches.pristine_tree(tmp_path / "tree")
    with pytest.raises(SystemExit) as failed:
        upstream_patches.apply_patches(tree, [broken])
    message_text = str(failed.value)
    assert message_text.startswith(f"{patch.name} no longer applies to vLLM-Omni 0.30.0")
    assert f"patch failed: {ADAPTER}:" in message_text


RULE_IMPORT = "from vllm_omni.distributed import managed_distributed as dist"


def _by_the_rule(text: str) -> str:
    """A module as the rule leaves it, blank lines and its own import aside: ``import torch.distributed as dist``
    gone, and ``torch.distributed.<op>(`` spelled ``dist.<op>(`` for each op ``managed_distributed`` stages."""
    from vllm_omni.distributed.managed_distributed import STAGED

    lines = [line for line in text.splitlines() if line.strip() not in ("", "import torch.distributed as dist")]
    spelled = re.compile(rf"(?<![\w.])torch\.distributed\.({'|'.join(sorted(STAGED))})\(")
    return "\n".join(spelled.sub(r"dist.\1(", line) for line in lines)


def test_the_rule_patch_makes_only_the_rules_edits_but_the_adapters_scope(tmp_path):
    before = upstream_patches.prefix_tree(tmp_path / "before", len(SERIES) - 1)
    after = upstream_patches.prefix_tree(tmp_path / "after", len(SERIES))
    touched = [name for name, *_ in upstream_patches._files(PATCHES[-1])
               if name.startswith("vllm_omni/") and name not in SERIES[-1].owns]  # fmt: skip
    assert len(touched) > 20
    for name in touched:
        lines = (after / name).read_text().splitlines()
        if name == ADAPTER:  # the checkpoint's remote code, scoped: one import, one call
            scoped = [line for line in lines if "scope_remote_code" in line]
            assert len(scoped) == 2 and [line for line in lines if line not in scoped] == (
                (before / name).read_text().splitlines()
            )
            continue
        assert [line.strip() for line in lines].count(RULE_IMPORT) == 1, name  # at the top, or where torch's was
        ruled = "\n".join(line for line in lines if line.strip() not in ("", RULE_IMPORT))
        assert ruled == _by_the_rule((before / name).read_text()), name
