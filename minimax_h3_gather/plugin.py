# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""``vllm_omni.general_plugins`` entry point: the released adapter calls the gather fix from its setup.

Upstream, ``MiniMaxH3VideoVAE.__init__`` ends with ``install_tile_gather_reuse(self)``. A released
vLLM-Omni does not, so this plugin, loaded by vLLM-Omni in every process that builds a model, makes
``__init__`` end with that call. It is the project's one runtime patch.
"""

from __future__ import annotations

import functools
import inspect
from importlib.metadata import PackageNotFoundError, version

from vllm.logger import init_logger

# Under vLLM-Omni's logger, so its handlers and level apply: a top-level name would drop the INFO line.
logger = init_logger(f"vllm_omni.plugins.{__name__}")

_HOOK_MARK = "_minimax_h3_tile_gather_hook"
# What the hook relies on: the adapter's setup takes the component path, and the adapter reads the
# checkpoint's parallel state the way install_tile_gather_reuse expects.
_EXPECTED_METHODS = ("set_parallel_size", "_native_parallel_state", "offload_to_cpu")
_warned = False


def _omni_version() -> str:
    try:
        return version("vllm-omni")
    except PackageNotFoundError:
        return "unknown"


def _warn_once(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning("[H3_VAE_GATHER] plugin patches nothing: %s (vllm-omni %s)", reason, _omni_version())


def _adapter_class():
    try:
        from vllm_omni.diffusion.models.minimax_h3 import vae
    except ImportError as exc:
        return None, f"cannot import vllm_omni.diffusion.models.minimax_h3.vae ({exc})"
    adapter = getattr(vae, "MiniMaxH3VideoVAE", None)
    if not isinstance(adapter, type):
        return None, "vllm_omni.diffusion.models.minimax_h3.vae has no MiniMaxH3VideoVAE class"
    missing = [name for name in _EXPECTED_METHODS if not callable(getattr(adapter, name, None))]
    params = list(inspect.signature(adapter.__init__).parameters)
    if missing or params[:2] != ["self", "component_path"]:
        return None, f"MiniMaxH3VideoVAE has another shape (missing {missing}, __init__{tuple(params)})"
    return adapter, None


def register() -> None:
    """Hook ``MiniMaxH3VideoVAE.__init__`` once per process; later loads are no-ops."""
    adapter, problem = _adapter_class()
    if adapter is None:
        _warn_once(problem)
        return
    original = adapter.__init__
    if getattr(original, _HOOK_MARK, False):
        return

    from vllm_omni.diffusion.models.minimax_h3.vae_gather import install_tile_gather_reuse

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        install_tile_gather_reuse(self)

    setattr(__init__, _HOOK_MARK, True)
    adapter.__init__ = __init__
    logger.info(
        "[H3_VAE_GATHER] plugin hooked %s.%s.__init__ to install the tile gather (vllm-omni %s)",
        adapter.__module__,
        adapter.__qualname__,
        _omni_version(),
    )
