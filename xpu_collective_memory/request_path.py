# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""On a released vLLM-Omni, staging's routing where upstream has it in the code.

Upstream, the diffusion ``GroupCoordinator`` calls ``persistent_collectives``, ``OmniPlatform`` has its
``collectives()``, and every module of the diffusion tree that calls a collective imports ``managed_distributed``
(or ``persistent_fsdp.fully_shard``) where it imported ``torch.distributed``. Here the same rule is applied to the
released modules in a diffusion worker, as each is loaded: every global of a ``vllm_omni.diffusion`` module that
names ``torch.distributed``, one of its staged collectives or FSDP2's ``fully_shard`` is rebound, and ``torch``
itself where the module calls ``torch.distributed.<collective>`` by its full name. A rule rather than a list: a
model added in a release is routed without an edit here, and ``python -m xpu_collective_memory.reach`` lists what is
left. A release whose hooked piece has another shape is logged and left as released; every rank runs the same
release, so every rank decides alike.
"""

from __future__ import annotations

import functools
import inspect
import re
from types import ModuleType

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from vllm.logger import init_logger

from vllm_omni.distributed import (
    managed_distributed,
    module_collectives,
    persistent_collectives,
    persistent_fsdp,
    request_collectives,
    traced_collectives,
)
from vllm_omni.platforms.interface import OmniPlatform

logger = init_logger(f"vllm_omni.plugins.{__name__}")

COORDINATOR_MODULE = "vllm_omni.diffusion.distributed.group_coordinator"
PLATFORM_MODULE = "vllm_omni.platforms.interface"
ROUTED_PACKAGE = "vllm_omni.diffusion."


def _eager_or_compiled(name: str):
    """The coordinator's method ``name`` as the series' patches 3 and 4 make it where the process stages: eager
    through ``request_collectives``, compiled through ``traced_collectives``."""
    eager, compiled = getattr(request_collectives, name), getattr(traced_collectives, name)

    @functools.wraps(eager, updated=())  # not its __dict__: Dynamo would take this one for disabled too
    def method(*args, **kwargs):
        return (compiled if torch.compiler.is_compiling() else eager)(*args, **kwargs)

    return method


_METHODS = {
    "all_reduce": (_eager_or_compiled("coordinator_all_reduce"), ["self", "input_", "op"]),
    "all_gather": (
        _eager_or_compiled("coordinator_all_gather"),
        ["self", "input_", "dim", "separate_tensors", "group"],
    ),
    "broadcast": (_eager_or_compiled("coordinator_broadcast"), ["self", "input_", "src"]),
}
COORDINATOR_OWNED = frozenset(_METHODS)  # the coordinator's methods replaced by the persistent ones
_MARK = "_persistent_collectives_hook"


class _TorchWithManagedDistributed(ModuleType):
    """``torch`` for a module that calls ``torch.distributed.<collective>`` by its full name."""

    def __init__(self) -> None:
        super().__init__("torch", torch.__doc__)
        self.distributed = managed_distributed

    def __getattr__(self, name: str):
        value = getattr(torch, name)
        setattr(self, name, value)  # looked up once: later reads are a dict's
        return value


_TORCH = _TorchWithManagedDistributed()
_FULL_NAME_CALL = re.compile(r"\btorch\.distributed\.(\w+)\(")


# Modules that hand the backend persistent memory of their own: staging their calls again would copy twice.
OWN_BLOCKS = frozenset({"vllm_omni.diffusion.models.minimax_h3.vae_gather"})


def routed(name: str) -> bool:
    """Whether the rule routes the module ``name``."""
    return name.startswith(ROUTED_PACKAGE) and name not in OWN_BLOCKS


def _calls_by_full_name(module: ModuleType) -> bool:
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return False
    return any(name in managed_distributed.STAGED for name in _FULL_NAME_CALL.findall(source))


def _stand_in(value, module: ModuleType):
    if value is dist:
        return managed_distributed
    if value is torch:
        return _TORCH if _calls_by_full_name(module) else None
    if value is fully_shard:
        return persistent_fsdp.fully_shard
    if value is dist.P2POp:  # torch's refuses the managed isend and irecv
        return managed_distributed.P2POp
    name = getattr(value, "__name__", None)
    if name in managed_distributed.STAGED and getattr(dist, name, None) is value:
        return getattr(managed_distributed, name)
    return None


def hook_coordinator(module: ModuleType) -> bool:
    """Route ``GroupCoordinator``'s collectives through the platform's and register each new coordinator."""
    cls = getattr(module, "GroupCoordinator", None)
    if not isinstance(cls, type):
        logger.warning("[XPU_COLLECTIVE_MEMORY] %s has no GroupCoordinator; left as released", module.__name__)
        return False
    if getattr(cls.__init__, _MARK, False):
        return True
    shapes = {name: list(inspect.signature(getattr(cls, name, lambda: None)).parameters) for name in _METHODS}
    if wrong := {name: params for name, params in shapes.items() if params != _METHODS[name][1]}:
        logger.warning("[XPU_COLLECTIVE_MEMORY] GroupCoordinator has another shape %s; left as released", wrong)
        return False
    for coordinator in (c for c in vars(module).values() if isinstance(c, type) and issubclass(c, cls)):
        if "__init__" in vars(coordinator):  # each __init__ of its own registers (the pipeline's calls no super)
            coordinator.__init__ = _registering(coordinator.__init__)
    for name, (function, _) in _METHODS.items():
        setattr(cls, name, function)
    return True


def _registering(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        persistent_collectives.register_coordinator(self)

    setattr(__init__, _MARK, True)
    return __init__


def hook_platform(module: ModuleType) -> bool:
    """``OmniPlatform.collectives()``, as the series' patch 3 adds it."""
    cls = getattr(module, "OmniPlatform", None)
    if not isinstance(cls, type):
        logger.warning("[XPU_COLLECTIVE_MEMORY] %s has no OmniPlatform; left as released", module.__name__)
        return False
    if "collectives" not in vars(cls):
        cls.collectives = classmethod(lambda cls: persistent_collectives.collectives_for(cls.device_type))
    return True


def rebind_module(module: ModuleType) -> list[str]:
    """Give a routed module the managed stand-in of each global that names torch.distributed's collectives."""
    rebound = []
    for name, value in list(vars(module).items()):
        stand_in = _stand_in(value, module)
        if stand_in is not None:
            setattr(module, name, stand_in)
            rebound.append(f"{module.__name__}.{name}")
    return rebound


def hook_for(name: str):
    """The hook of the module ``name`` in a diffusion worker, or None."""
    if name == COORDINATOR_MODULE:
        return _coordinator_and_module
    if name == PLATFORM_MODULE:
        return hook_platform
    return rebind_module if routed(name) else None


def _coordinator_and_module(module: ModuleType) -> bool:
    rebind_module(module)  # its tensor-dict and point-to-point methods call torch.distributed
    return hook_coordinator(module)


def staged_stats(loading_too: bool = False) -> dict[str, int] | None:
    """The figures of this process's staged collectives, the coordinator's and the modules' calls together; None
    where it does not stage (``loading_too``: also while its worker loads), as where the platform was left released."""
    if "collectives" not in vars(OmniPlatform):
        return None
    choice = request_collectives.platform_choice() if loading_too else request_collectives.platform_collectives()
    if not choice.staged:
        return None
    modules, coordinators = module_collectives._PERSISTENT.stats(), choice.stats()  # modules': the shared blocks too
    counts = ("staged_calls", "chunked_calls", "fallbacks", "payload_bytes", "staged_bytes")
    return modules | {key: modules[key] + coordinators[key] for key in counts}
