# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Tiny checkpoints, written on demand from a fixed seed, that the released vLLM-Omni loads as the real ones.

``build_synthetic_checkpoint`` writes MiniMax-H3's video VAE component alone (config with ``auto_map.AutoModel``,
the remote code transformers' dynamic-module loader imports, safetensors weights); ``pipeline`` writes the whole
MiniMax-H3 pipeline around one, ``wan2_2`` and ``qwen_image`` a Wan2.2 and a Qwen-Image checkpoint in diffusers'
layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

CACHE_ENV = "VLLM_OMNI_TEST_SYNTHETIC_CACHE"
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


def fingerprint(*parts: object, files: tuple[Path, ...] = ()) -> str:
    """A short digest of what a build writes: its settings and the source files it copies or runs."""
    digest = hashlib.sha256(json.dumps([parts, SEED], default=str).encode())
    for path in (*files, *(REMOTE_CODE / name for name in REMOTE_FILES)):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def default_cache_dir() -> Path:
    value = os.environ.get(CACHE_ENV)
    if value is not None and not value.strip():
        raise ValueError(f"{CACHE_ENV} is set but empty; expected a directory path")
    return Path(value) if value else Path.home() / ".cache" / "vllm_omni_synthetic_checkpoints"


def build_once(target: Path, write: Callable[[Path], None], marker: str) -> Path:
    """Run ``write`` into a staging directory and move it to ``target``, unless ``target/marker`` exists.

    Concurrent builders (ranks, test workers) race safely: the first rename wins, the others drop their copy.
    """
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            write(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / marker).is_file():  # not a concurrent builder that won
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_video_vae(path: Path, model_config: dict) -> None:
    """The video VAE component: config with ``auto_map`` and latent statistics, weights, and the remote code."""
    from .remote_code.modeling_minimax_h3_vae import MiniMaxH3VideoVAEModel

    MiniMaxH3VideoVAEModel(**model_config).save_pretrained(path, safe_serialization=True)
    config = json.loads((path / "config.json").read_text())
    channels = model_config["latent_channels"]
    config.update(
        auto_map={"AutoModel": "modeling_minimax_h3_vae.MiniMaxH3VideoVAEModel"},
        latents_mean=[0.1 * (c + 1) for c in range(channels)],
        latents_std=[1.0 + 0.25 * c for c in range(channels)],
    )
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for name in REMOTE_FILES:
        shutil.copyfile(REMOTE_CODE / name, path / name)


def build_synthetic_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """The video VAE component directory alone, written once per content fingerprint; returns its path."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / fingerprint(MODEL_CONFIG) / "video_vae"
    return build_once(target, lambda path: write_video_vae(path, MODEL_CONFIG), "config.json")
