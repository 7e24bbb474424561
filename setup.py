# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The whole-request fix for device memory that grows every request when vLLM-Omni serves diffusion models on XPU.

``vllm_omni/diffusion/models/minimax_h3/vae_gather.py`` and the collectives' layer in ``vllm_omni/distributed/``
are laid out exactly where upstream keeps them, with no ``__init__.py`` of ours on the way, so ``pip install .``
drops them into the installed vLLM-Omni package. ``xpu_collective_memory`` holds the rest of what an operator runs:
the plugin that applies the fix to a released vLLM-Omni, the reach check and the collective census. The tooling,
the benchmarks and the tests are not installed.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).parent


def _requirements(name: str) -> list[str]:
    lines = (ROOT / "requirements" / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith(("#", "-r"))]


setup(
    name="vllm-omni-xpu-collective-memory",
    version="0.13.0",
    description=(
        "vLLM-Omni diffusion serving on Intel XPU without device memory growing every request: collectives' "
        "buffers that stay put (persistent blocks or one memory pool per worker), MiniMax-H3's VAE tile gather first"
    ),
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10,<3.14",
    packages=find_namespace_packages(
        include=["vllm_omni.diffusion.models.minimax_h3", "vllm_omni.distributed", "xpu_collective_memory"]
    ),
    install_requires=_requirements("common.txt"),
    entry_points={
        "vllm_omni.general_plugins": [
            "xpu_collective_memory = xpu_collective_memory.plugin:register",
            "xpu_collective_census = xpu_collective_memory.census:register",
            # The names before 0.12.0, honoured until 0.13.0 with a warning (xpu_collective_memory/renamed.py).
            "minimax_h3_vae_gather = xpu_collective_memory.plugin:register_minimax_h3_vae_gather",
            "minimax_h3_census = xpu_collective_memory.census:register_minimax_h3_census",
        ],
    },
)
