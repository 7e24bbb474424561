# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""On a released vLLM-Omni, the whole-request fix where patch 0002 puts it upstream.

Patch 0002 makes the diffusion ``GroupCoordinator`` call ``persistent_collectives``, gives ``OmniPlatform`` its
``collectives()``, and imports ``managed_distributed as dist`` in the request path's modules. Here the same
functions are bound onto the released classes and modules, in a diffusion worker before its groups are made.
A release whose hooked piece has another shape is logged and left as released; every rank runs the same
release, so every rank decides alike.
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType

import torch
import torch.distributed as dist
from vllm.logger import init_logger

from vllm_omni.distributed import managed_distributed, persistent_collectives

logger = init_logger(f"vllm_omni.plugins.{__name__}")

COORDINATOR_MODULE = "vllm_omni.diffusion.distributed.group_coordinator"
PLATFORM_MODULE = "vllm_omni.platforms.interface"
# Each request-path module and the globals of it that name torch.distributed, as patch 0002 edits them.
MODULES = {
    "vllm_omni.diffusion.models.minimax_h3.pipeline_minimax_h3": ("dist", "torch"),  # torch.distributed.broadcast
    "vllm_omni.diffusion.models.minimax_h3.chunked_decode": ("dist",),
    "vllm_omni.diffusion.distributed.comm": ("dist",),
    "vllm_omni.diffusion.attention.parallel.ulysses": ("dist",),
    "vllm_omni.diffusion.distributed.autoencoders.distributed_vae_executor": ("dist",),  # VAE tile parallelism
}
_METHODS = {
    "all_reduce": (persistent_collectives.coordinator_all_reduce, ["self", "input_", "op"]),
    "all_gather": (
        persistent_collectives.coordinator_all_gather,
        ["self", "input_", "dim", "separate_tensors", "group"],
    ),
    "broadcast": (persistent_collectives.coordinator_broadcast, ["self", "input_", "src"]),
}
_MARK = "_persistent_collectives_hook"


class _TorchWithManagedDistributed(ModuleType):
    """``torch`` for a module that calls ``torch.distributed.<collective>`` by its full name."""

    def __init__(self) -> None:
        super().__init__("torch", torch.__doc__)
        self.distributed = managed_distributed

    def __getattr__(self, name: str):
        return getattr(torch, name)


_STAND_INS = {"dist": (dist, managed_distributed), "torch": (torch, _TorchWithManagedDistributed())}


def hook_coordinator(module: ModuleType) -> bool:
    """Route ``GroupCoordinator``'s collectives through the platform's and register each new coordinator."""
    cls = getattr(module, "GroupCoordinator", None)
    if not isinstance(cls, type):
        logger.warning("[PERSISTENT_COLLECTIVES] %s has no GroupCoordinator; left as released", module.__name__)
        return False
    if getattr(cls.__init__, _MARK, False):
        return True
    shapes = {name: list(inspect.signature(getattr(cls, name, lambda: None)).parameters) for name in _METHODS}
    if wrong := {name: params for name, params in shapes.items() if params != _METHODS[name][1]}:
        logger.warning("[PERSISTENT_COLLECTIVES] GroupCoordinator has another shape %s; left as released", wrong)
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
    """``OmniPlatform.collectives()``, as patch 0002 adds it."""
    cls = getattr(module, "OmniPlatform", None)
    if not isinstance(cls, type):
        logger.warning("[PERSISTENT_COLLECTIVES] %s has no OmniPlatform; left as released", module.__name__)
        return False
    if "collectives" not in vars(cls):
        cls.collectives = classmethod(lambda cls: persistent_collectives.collectives_for(cls.device_type))
    return True


def rebind_module(module: ModuleType) -> list[str]:
    """Give a request-path module ``managed_distributed`` for the globals that name ``torch.distributed``."""
    names = [name for name in MODULES[module.__name__] if name in vars(module)]
    if other := [name for name in names if vars(module)[name] not in _STAND_INS[name]]:
        logger.warning("[PERSISTENT_COLLECTIVES] %s.%s is not what it was; left as released", module.__name__, other)
        return []
    for name in names:
        setattr(module, name, _STAND_INS[name][1])
    return [f"{module.__name__}.{name}" for name in names]


HOOKS = {
    COORDINATOR_MODULE: hook_coordinator,
    PLATFORM_MODULE: hook_platform,
    **dict.fromkeys(MODULES, rebind_module),
}
