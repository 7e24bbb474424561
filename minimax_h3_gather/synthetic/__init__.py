# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""A small MiniMax-H3 video VAE checkpoint, written on demand, that the released adapter loads as the real one.

The component directory holds ``config.json`` with ``auto_map.AutoModel``, the remote-code files that
transformers' dynamic-module loader imports from it, and safetensors weights drawn from a fixed seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

CACHE_ENV = "VLLM_OMNI_H3_SYNTHETIC_CACHE"
REMOTE_CODE = Path(__file__).with_name("remote_code")
REMOTE_FILES = ("modeling_minimax_h3_vae.py", "klvae.py", "parallel.py")
SEED = 20261202
MODEL_CONFIG = {
    "latent_channels": 4,
    "hidden_channels": 32,
    "vae_ratio": 8,
    "temporal_ratio": 4,
    "vae_clip_length": 2,
    "vae_tile_size": 64,
    "vae_tile_overlap_min": 16,
    "vae_parallel_tiling": 1,
}


def _fingerprint() -> str:
    digest = hashlib.sha256(json.dumps([MODEL_CONFIG, SEED]).encode())
    for name in REMOTE_FILES:
        digest.update((REMOTE_CODE / name).read_bytes())
    return digest.hexdigest()[:16]


def default_cache_dir() -> Path:
    value = os.environ.get(CACHE_ENV)
    if value is not None and not value.strip():
        raise ValueError(f"{CACHE_ENV} is set but empty; expected a directory path")
    return Path(value) if value else Path.home() / ".cache" / "minimax_h3_gather"


def build_synthetic_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Write the component directory once per content fingerprint and return its path."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    component = root / _fingerprint() / "video_vae"
    if (component / "config.json").is_file():
        return component
    from .remote_code.modeling_minimax_h3_vae import MiniMaxH3VideoVAEModel

    component.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=component.parent, prefix=".build-"))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            MiniMaxH3VideoVAEModel(**MODEL_CONFIG).save_pretrained(staging, safe_serialization=True)
        config = json.loads((staging / "config.json").read_text())
        channels = MODEL_CONFIG["latent_channels"]
        config.update(
            auto_map={"AutoModel": "modeling_minimax_h3_vae.MiniMaxH3VideoVAEModel"},
            latents_mean=[0.1 * (c + 1) for c in range(channels)],
            latents_std=[1.0 + 0.25 * c for c in range(channels)],
        )
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        for name in REMOTE_FILES:
            shutil.copyfile(REMOTE_CODE / name, staging / name)
        try:
            staging.rename(component)
        except OSError:
            if not (component / "config.json").is_file():  # not a concurrent builder that won
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return component
