# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The versions this process runs, and which distribution's ``vae_gather.py`` Python runs where a vLLM-Omni release
ships one of its own.

``pip install .`` lays this project's ``vae_gather.py`` into the installed vLLM-Omni package. Should a
vLLM-Omni release carry a file of that name, one of the two installs silently replaces the other; this
check names both versions and the one on disk, from the hashes in each distribution's ``RECORD``.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from importlib.metadata import PackageNotFoundError, distribution, version

OVERLAY_FILE = "vllm_omni/diffusion/models/minimax_h3/vae_gather.py"
PROJECT_DIST = "vllm-omni-xpu-collective-memory"


def _version(dist_name: str) -> str:
    try:
        return version(dist_name)
    except PackageNotFoundError:
        return "unknown"


def omni_version() -> str:
    return _version("vllm-omni")


def project_version() -> str:
    return _version(PROJECT_DIST)


def running() -> str:
    """What this process runs, for log lines and reports: this project's version on vLLM-Omni's."""
    return f"{PROJECT_DIST} {project_version()} on vllm-omni {omni_version()}"


def _recorded(dist_name: str):
    """``(version, RECORD entry)`` of the overlay file in ``dist_name``, or None."""
    try:
        dist = distribution(dist_name)
    except PackageNotFoundError:
        return None
    entry = next((f for f in dist.files or () if str(f).replace("\\", "/") == OVERLAY_FILE), None)
    return None if entry is None else (dist.version, entry)


def _matches(entry) -> bool:
    if entry.hash is None or entry.hash.mode != "sha256":
        return False
    try:
        digest = hashlib.sha256(entry.locate().read_bytes()).digest()
    except OSError:
        return False
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == entry.hash.value


def overlay_conflict() -> str | None:
    """A sentence naming both versions when vLLM-Omni ships its own ``vae_gather.py``; None otherwise."""
    omni, ours = _recorded("vllm-omni"), _recorded(PROJECT_DIST)
    if omni is None:
        return None
    found = {"vllm-omni": omni, PROJECT_DIST: ours}
    on_disk = [f"{name} {record[0]}" for name, record in found.items() if record and _matches(record[1])]
    ours_text = f"{PROJECT_DIST} {ours[0]}" if ours else f"{PROJECT_DIST} (not installed)"
    return (
        f"vllm-omni {omni[0]} ships its own {OVERLAY_FILE}, as does {ours_text}; the file on disk is "
        f"{' and '.join(on_disk) or 'neither'}'s. Reinstall the one you mean to run last"
    )


def check_overlay(logger: logging.Logger) -> None:
    if (conflict := overlay_conflict()) is not None:
        logger.warning("[XPU_COLLECTIVE_MEMORY] %s", conflict)
