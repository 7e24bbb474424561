# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Which collectives of the installed vLLM-Omni's diffusion tree hand the backend persistent buffers.

``python -m xpu_collective_memory.reach`` reads the tree's source (nothing is imported from it) and lists every
collective call site: ``torch.distributed`` under any name, functional collectives, ``GroupCoordinator`` methods
and FSDP2 wraps. A site is routed when, in a diffusion worker, it reaches ``managed_distributed``, the
coordinator's persistent collectives or ``persistent_fsdp``, eager and traced alike: through the plugin's rule
(``request_path``) or, in a patched tree, through its own import. The rule rebinds a module's globals, so a call
through a function's own ``import torch.distributed`` or through another part of ``torch.distributed``
(``distributed_c10d``, ``nn.functional``) is never routed. ``reach_table`` gives the reviewed status of the
rest (and of routed sites that stay plain: load-time and control calls); the command exits 1 on a request-path
site that is not routed and on any site the table does not know, so a release or a model that adds one fails CI.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from .reach_table import FAILING, REASONS, Status

TORCH_DISTRIBUTED = "torch.distributed"
MANAGED_MODULE = "vllm_omni.distributed.managed_distributed"
PERSISTENT_FSDP_MODULE = "vllm_omni.distributed.persistent_fsdp"
FUNCTIONAL_MODULE = "torch.distributed._functional_collectives"
COLLECTIVES = frozenset(
    {
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single", "all_to_all",
        "all_to_all_single", "reduce_scatter_single",
        "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list", "gather", "gather_object", "irecv",
        "isend", "monitored_barrier", "recv", "recv_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
        "scatter", "scatter_object_list", "send", "send_object_list",
    }
)  # fmt: skip
FUNCTIONAL = frozenset(
    {
        "all_gather_tensor", "all_gather_tensor_autograd", "all_reduce", "all_to_all_single",
        "all_to_all_single_autograd", "broadcast", "permute_tensor", "reduce_scatter_tensor",
        "reduce_scatter_tensor_autograd",
    }
)  # fmt: skip
COORDINATOR_MODULE = "distributed/group_coordinator.py"  # relative to the diffusion tree
COORDINATOR_METHODS = frozenset(
    {
        "all_reduce", "all_gather", "all_to_all", "broadcast", "broadcast_object", "broadcast_object_list",
        "broadcast_tensor_dict", "barrier", "gather", "irecv_tensor_dict", "isend_tensor_dict", "pipeline_isend",
        "pipeline_recv", "pipeline_send", "recv", "recv_object", "recv_tensor_dict", "reduce_scatter", "send",
        "send_object", "send_tensor_dict",
    }
)  # fmt: skip

_COORDINATOR_NAME = re.compile(r"(group|coordinator)(\(\))?$")


@dataclass(frozen=True)
class Site:
    path: str  # relative to the diffusion tree
    line: int
    scope: str  # the enclosing function's qualified name, or "<module>"
    op: str
    via: str  # "dist", "local" (a function's own import), "managed", "functional", "other", "coordinator", "fsdp"
    asynchronous: bool = False

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.path, self.scope, self.op)


@dataclass(frozen=True)
class Verdict:
    site: Site
    status: Status
    reason: str


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports a scope's own statements run, not those of the functions and classes it defines."""
    pending = list(body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, _SCOPES):
            pending.extend(ast.iter_child_nodes(node))


def _bindings(body: list[ast.stmt]) -> dict[str, str]:
    """Each name a scope binds by import, by dotted target."""
    names: dict[str, str] = {}
    for node in _imports(body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    names.setdefault(alias.name.split(".")[0], alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.expr, scopes: list[dict[str, str]]) -> tuple[str, bool] | None:
    """``dist.all_reduce`` as ``torch.distributed.all_reduce`` where ``dist`` is bound so, and whether a function's
    own import binds it (``scopes``: the module's names, then each enclosing scope's); None if not a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    depth = next((i for i in range(len(scopes) - 1, -1, -1) if node.id in scopes[i]), 0)
    return ".".join([scopes[depth].get(node.id, node.id), *reversed(parts)]), depth > 0


def _is_async(call: ast.Call) -> bool:
    return any(
        k.arg == "async_op" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
        for k in call.keywords
    )


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str, tree: ast.Module) -> None:
        self.path, self.scopes, self.scope, self.sites = path, [_bindings(tree.body)], [], []

    def _visit_scope(self, node) -> None:
        self.scope.append(node.name)
        self.scopes.append(_bindings(node.body))
        self.generic_visit(node)
        self.scopes.pop()
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _visit_scope

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        site = self._site(node)
        if site is not None:
            self.sites.append(site)

    def _site(self, call: ast.Call) -> Site | None:
        resolved = _dotted(call.func, self.scopes)
        scope = ".".join(self.scope) or "<module>"
        if resolved is not None:
            (module, _, op), local = resolved[0].rpartition("."), resolved[1]
            for prefix, via, ops in (
                (TORCH_DISTRIBUTED, "local" if local else "dist", COLLECTIVES),  # the rule rebinds globals only
                (MANAGED_MODULE, "managed", COLLECTIVES),
                (FUNCTIONAL_MODULE, "functional", FUNCTIONAL),
            ):
                if module == prefix and op in ops:
                    return Site(self.path, call.lineno, scope, op, via, _is_async(call))
            if op == "fully_shard" and module.startswith(TORCH_DISTRIBUTED):
                return Site(self.path, call.lineno, scope, op, "fsdp")
            if op == "fully_shard" and module == PERSISTENT_FSDP_MODULE:
                return Site(self.path, call.lineno, scope, op, "managed")
            if module.startswith(TORCH_DISTRIBUTED) and op in COLLECTIVES | FUNCTIONAL:
                return Site(self.path, call.lineno, scope, op, "other")  # distributed_c10d, nn.functional, ...
            if module.split(".")[0] in ("torch", "dist") or any(module in names.values() for names in self.scopes):
                return None  # another function of a module, e.g. dist.get_rank
        if isinstance(call.func, ast.Attribute) and call.func.attr in COORDINATOR_METHODS and self._coordinator(call):
            return Site(self.path, call.lineno, scope, call.func.attr, "coordinator", _is_async(call))
        return None

    def _coordinator(self, call: ast.Call) -> bool:
        """Whether the receiver names a group coordinator (``get_sp_group()``, ``self.cfg_group``, ``self`` in one)."""
        receiver = ast.unparse(call.func.value)
        return bool(_COORDINATOR_NAME.search(receiver)) or (receiver == "self" and self.path == COORDINATOR_MODULE)


def diffusion_tree() -> Path:
    """The installed vLLM-Omni's ``diffusion`` directory, found without importing vLLM-Omni."""
    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm_omni is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations))) / "diffusion"


def scan(root: Path) -> Iterator[Site]:
    for file in sorted(root.rglob("*.py")):
        path = file.relative_to(root).as_posix()
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        scanner = _Scanner(path, tree)
        scanner.visit(tree)
        yield from scanner.sites


def _routes(site: Site, ruled: bool, staged: frozenset[str]) -> str | None:
    """How a direct call reaches the managed collectives, or None."""
    if site.via == "fsdp":
        return "persistent_fsdp.fully_shard" if ruled else None
    if site.via == "managed" or (site.via == "dist" and ruled):
        if site.op == "fully_shard":
            return "persistent_fsdp.fully_shard"
        return "managed_distributed" if site.op in staged else None
    return None


def verdicts(sites: list[Site], ruled: bool, coordinator_owned: bool) -> list[Verdict]:
    """Each site's status. ``ruled``: the plugin's rule routes the tree (else only its own imports do);
    ``coordinator_owned``: the coordinator's own collectives are the persistent ones (the plugin, or the series'
    patch 3)."""
    from vllm_omni.distributed.managed_distributed import STAGED

    from .request_path import COORDINATOR_OWNED, OWN_BLOCKS

    direct = {site: _routes(site, ruled, STAGED) for site in sites if site.via != "coordinator"}
    for site in direct:
        if f"vllm_omni.diffusion.{site.path.removesuffix('.py').replace('/', '.')}" in OWN_BLOCKS:
            direct[site] = "its own persistent workspace"
    # A coordinator method not replaced by the persistent ones is routed when every call in its body is.
    bodies: dict[str, bool] = {}
    for site, route in direct.items():
        if site.path == COORDINATOR_MODULE and "." in site.scope:
            method = site.scope.split(".")[1]
            bodies[method] = bodies.get(method, True) and route is not None
    out = []
    for site in sites:
        if site.via == "coordinator":
            owned = coordinator_owned and site.op in COORDINATOR_OWNED
            route = "request_collectives" if owned else ("its body" if bodies.get(site.op) else None)
        else:
            route = direct[site]
        if site.key in REASONS:  # reviewed: plain at run time where routed, or never reached
            out.append(Verdict(site, *REASONS[site.key]))
        elif route is not None:
            out.append(Verdict(site, "routed", f"through {route}"))
        else:
            out.append(Verdict(site, "unknown", "not routed and not in reach_table"))
    return out


def _table(verdicts: list[Verdict]) -> str:
    rows = [f"{v.status:12} {v.site.path}:{v.site.line} {v.site.scope} {v.site.via}.{v.site.op}" for v in verdicts]
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m xpu_collective_memory.reach",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Prints the sites that are not routed (every site with --all) and a count per verdict. Needs: the "
        "vLLM-Omni it reads, installed or as --tree; no card, no server. Exit status: 0 when every site is routed or "
        "reviewed, 1 when one is neither (each is named on stderr), 2 on a bad argument.",
    )
    parser.add_argument("--tree", type=Path, default=None, help="a diffusion tree; the installed one if not given")
    parser.add_argument(
        "--without-plugin", action="store_true", help="only what the tree routes itself (a patched tree)"
    )
    parser.add_argument("--json", action="store_true", help="every site and its verdict, as JSON")
    parser.add_argument("--all", action="store_true", help="list routed sites too")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tree = args.tree or diffusion_tree()
    coordinator = tree / COORDINATOR_MODULE
    owned = not args.without_plugin or "request_collectives" in coordinator.read_text(encoding="utf-8")
    found = verdicts(list(scan(tree)), ruled=not args.without_plugin, coordinator_owned=owned)
    failing = [v for v in found if v.status in FAILING]
    if args.json:
        print(json.dumps([{**asdict(v.site), "status": v.status, "reason": v.reason} for v in found], indent=1))
    else:
        shown = found if args.all else [v for v in found if v.status != "routed"]
        print(_table(shown))
        counts = {status: sum(v.status == status for v in found) for status in dict.fromkeys(v.status for v in found)}
        print(f"{tree}: {len(found)} collective call sites: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    for verdict in failing:
        print(f"FAIL {verdict.site.path}:{verdict.site.line} {verdict.site.op}: {verdict.reason}", file=sys.stderr)
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
