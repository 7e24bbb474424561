# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""A Wan2.2 text-to-video checkpoint (two experts), tiny and random, in diffusers' layout.

``model_index.json`` names ``WanPipeline``, which vLLM-Omni serves with its own ``Wan22Pipeline``: the UMT5
text encoder, its tokenizer and the Wan VAE through ``from_pretrained``, both transformers through vLLM-Omni's
weight loader. Widths are small; what the parallel layouts need is kept: 4 heads (TP 4, Ulysses 4, or 2 x CFG
2), even head dims that split into RoPE's three axes, and a request large enough that the VAE decodes in tiles.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import build_once, default_cache_dir, fingerprint

TEXT_ENCODER = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 1, "num_heads": 4}
TRANSFORMER = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 4,
    "attention_head_dim": 24,  # a multiple of 6: RoPE splits it into time, height and width
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": TEXT_ENCODER["d_model"],
    "freq_dim": 16,
    "ffn_dim": 192,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}
VAE = {
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
}
# 320 px latents (40) exceed the VAE's 32-latent tile, so it decodes 2 x 2 tiles per latent frame, spread over the
# ranks; 2 steps at the default boundary (0.875) run the high-noise expert, then the low-noise one.
REQUEST = {
    "height": 320,
    "width": 320,
    "num_frames": 5,
    "num_inference_steps": 2,
    "guidance_scale": 4.0,
    "negative_prompt": "blurry, low quality",
    "fps": 8,
}
SPECIAL_TOKENS = {"<pad>": 0, "</s>": 1, "<unk>": 2}


def build_synthetic_wan2_2(cache_dir: str | os.PathLike | None = None) -> Path:
    """Write the checkpoint once per content fingerprint; returns its directory."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = fingerprint(TEXT_ENCODER, TRANSFORMER, VAE, SPECIAL_TOKENS, files=(Path(__file__),))
    return build_once(root / key / "Wan2.2-T2V-synthetic", _write_checkpoint, "model_index.json")


def _write_checkpoint(path: Path) -> None:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = _write_tokenizer(path / "tokenizer")
    config = UMT5Config(vocab_size=len(tokenizer), **TEXT_ENCODER, decoder_start_token_id=0)
    UMT5EncoderModel(config).save_pretrained(path / "text_encoder", safe_serialization=True)
    for name in ("transformer", "transformer_2"):
        WanTransformer3DModel(**TRANSFORMER).save_pretrained(path / name, safe_serialization=True)
    channels = VAE["z_dim"]
    means, stds = [0.05 * c - 0.4 for c in range(channels)], [1.0 + 0.1 * c for c in range(channels)]
    AutoencoderKLWan(**VAE, latents_mean=means, latents_std=stds).save_pretrained(path / "vae", safe_serialization=True)
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0).save_pretrained(
        path / "scheduler"
    )
    index = {
        "_class_name": "WanPipeline",
        "boundary_ratio": 0.875,
        "expand_timesteps": False,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer(path: Path):
    """Byte-level BPE with no merges (every byte a token), ending each prompt with ``</s>``, as T5's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = SPECIAL_TOKENS | {char: i + len(SPECIAL_TOKENS) for i, char in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(path)
    return tokenizer
