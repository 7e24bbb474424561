# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The names operators may have set in an earlier release, honoured for one more with a warning naming the new one.

0.12.0 renamed the distribution (``minimax-h3-vae-gather`` to ``vllm-omni-xpu-collective-memory``): two names reach
a running server from the operator's own configuration, the entry points in ``VLLM_PLUGINS`` and the census
directory variable. 0.12.2 gave the request pool its own variable, in place of
``VLLM_OMNI_PERSISTENT_COLLECTIVES=pool``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from vllm.logger import init_logger

logger = init_logger(f"vllm_omni.plugins.{__name__}")

# The entry points' names (setup.py), and old name -> new one: both are registered by this distribution until 0.13.0.
PLUGIN = "xpu_collective_memory"
CENSUS_PLUGIN = "xpu_collective_census"
ENTRY_POINTS = {"minimax_h3_vae_gather": PLUGIN, "minimax_h3_census": CENSUS_PLUGIN}
CENSUS_ENV_BEFORE_0_12 = "VLLM_OMNI_H3_CENSUS_DIR"
_warned: set[str] = set()


def listed_plugins() -> list[str] | None:
    """``VLLM_PLUGINS`` as vLLM's loader reads it (``vllm.envs``: split at commas, nothing stripped)."""
    raw = os.environ.get("VLLM_PLUGINS")
    return None if raw is None else raw.split(",")


def old_entry_point(old: str, register: Callable[[], None]) -> Callable[[], None]:
    """The entry point under its old name: it registers only where ``VLLM_PLUGINS`` picks the old name alone.

    With ``VLLM_PLUGINS`` unset vLLM-Omni loads every entry point of the group, the new one included, so the old one
    does nothing; where both names are listed the new one registers.
    """
    new = ENTRY_POINTS[old]

    def load_under_old_name() -> None:
        listed = listed_plugins()
        if listed is None or old not in listed:
            return
        if old not in _warned:  # vLLM-Omni may load the plugins again in one process: warn once
            _warned.add(old)
            _warn_old_name(old, new, listed)
        if new not in listed:
            register()

    load_under_old_name.__name__ = f"register_{old}"
    return load_under_old_name


def _warn_old_name(old: str, new: str, listed: list[str]) -> None:
    logger.warning(
        "[XPU_COLLECTIVE_MEMORY] VLLM_PLUGINS names %r, renamed %r in 0.12.0; the old name stops working in "
        "0.13.0: set VLLM_PLUGINS=%s",
        old,
        new,
        ",".join(dict.fromkeys(new if name.strip() == old else name.strip() for name in listed if name.strip())),
    )


def census_dir_variable(env_name: str) -> tuple[str, str] | None:
    """``(variable, value)`` of the census directory, reading ``VLLM_OMNI_H3_CENSUS_DIR`` where the new one is unset.

    Both set to different values is an error rather than a guess.
    """
    new, old = os.environ.get(env_name), os.environ.get(CENSUS_ENV_BEFORE_0_12)
    if old is None:
        return None if new is None else (env_name, new)
    if new is not None and new != old:
        raise ValueError(
            f"{env_name}={new!r} and {CENSUS_ENV_BEFORE_0_12}={old!r} disagree; set {env_name} only "
            f"({CENSUS_ENV_BEFORE_0_12} is its name before 0.12.0)"
        )
    if new is None:
        logger.warning(
            "[COLLECTIVE_CENSUS] %s is renamed %s in 0.12.0; the old name stops working in 0.13.0",
            CENSUS_ENV_BEFORE_0_12,
            env_name,
        )
    return env_name if new is not None else CENSUS_ENV_BEFORE_0_12, old


def old_pool_switch(environ=os.environ) -> None:
    """``VLLM_OMNI_PERSISTENT_COLLECTIVES=pool`` (before 0.12.2) read as ``VLLM_OMNI_DIFFUSION_REQUEST_MEM_POOL=1``
    with the collectives switch unset, in this process and the workers it starts; until 0.14.0, with a warning."""
    from vllm_omni.distributed.persistent_collectives import SWITCH_ENV
    from vllm_omni.distributed.request_pool import POOL_ENV

    raw = environ.get(SWITCH_ENV)
    if raw is None or raw.strip().lower() != "pool":
        return
    if environ.get(POOL_ENV, "1").strip() != "1":
        raise ValueError(
            f"{SWITCH_ENV}={raw!r} (the request pool, before 0.12.2) and {POOL_ENV}={environ[POOL_ENV]!r} disagree; "
            f"set {POOL_ENV}=1 and unset {SWITCH_ENV}"
        )
    environ[POOL_ENV] = "1"
    del environ[SWITCH_ENV]
    if SWITCH_ENV not in _warned:
        _warned.add(SWITCH_ENV)
        logger.warning(
            "[XPU_COLLECTIVE_MEMORY] %s=pool is %s=1 since 0.12.2; the old value stops working in 0.14.0: set "
            "%s=1 and unset %s",
            SWITCH_ENV,
            POOL_ENV,
            POOL_ENV,
            SWITCH_ENV,
        )
