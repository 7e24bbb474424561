# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Address-stable tile gather for the MiniMax-H3 video VAE, installable over a released vLLM-Omni.

``vllm_omni/diffusion/models/minimax_h3/vae_gather.py`` and the persistent-collectives layer in
``vllm_omni/distributed/`` are laid out exactly where upstream keeps them, with no ``__init__.py`` of ours on
the way, so ``pip install .`` drops them into the installed vLLM-Omni package. ``minimax_h3_gather`` holds the
rest of what an operator runs: the plugin that calls the fixes from the released vLLM-Omni, and the collective
census. The reproducer's tooling
(``minimax_h3_bench``) and the tests are not installed.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).parent


def _requirements(name: str) -> list[str]:
    lines = (ROOT / "requirements" / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith(("#", "-r"))]


setup(
    name="minimax-h3-vae-gather",
    version="0.11.0",
    description="Address-stable tile gather for the MiniMax-H3 video VAE in vLLM-Omni (XPU memory-leak fix)",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10,<3.14",
    packages=find_namespace_packages(
        include=["vllm_omni.diffusion.models.minimax_h3", "vllm_omni.distributed", "minimax_h3_gather"]
    ),
    install_requires=_requirements("common.txt"),
    entry_points={
        "vllm_omni.general_plugins": [
            "minimax_h3_vae_gather = minimax_h3_gather.plugin:register",
            "minimax_h3_census = minimax_h3_gather.census:register",
        ],
    },
)
