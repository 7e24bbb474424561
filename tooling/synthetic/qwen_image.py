# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""A Qwen-Image text-to-image checkpoint, tiny and random, in diffusers' layout.

``model_index.json`` names ``QwenImagePipeline``, which vLLM-Omni serves with its own: the Qwen2.5-VL text encoder
(its vision tower is dropped at load) and tokenizer through transformers, the Qwen-Image VAE through its
tile-parallel subclass, the transformer through vLLM-Omni's weight loader. What the layouts need is kept: 4 heads
(TP 4, Ulysses 4, 2 x CFG 2), text beside the image in joint attention, 400 image tokens (divisible by 4), and a
320 px image whose 40-latent side decodes in 2 x 2 tiles. Weights are bf16, the dtype the transformer runs in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import build_once, default_cache_dir, fingerprint

HIDDEN = 32  # the text encoder's width, which the transformer's joint_attention_dim must match
TEXT_CONFIG = {
    "hidden_size": HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},  # head_dim / 2
}
VISION_CONFIG = {  # built and saved, never run: the pipeline deletes the tower after loading
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": HIDDEN,
    "fullatt_block_indexes": [0],
}
TRANSFORMER = {
    "patch_size": 2,
    "in_channels": 64,  # 4 x the VAE's 16 latent channels, packed 2 x 2
    "out_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 4,
    "joint_attention_dim": HIDDEN,
    "guidance_embeds": False,
    "axes_dims_rope": [8, 12, 12],  # sums to the head dim
}
VAE = {
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
}
REQUEST = {
    "height": 320,
    "width": 320,
    "num_inference_steps": 2,
    "true_cfg_scale": 4.0,
    "negative_prompt": "blurry, low quality",
}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_synthetic_qwen_image(cache_dir: str | os.PathLike | None = None) -> Path:
    """Write the checkpoint once per content fingerprint; returns its directory."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = fingerprint(TEXT_CONFIG, VISION_CONFIG, TRANSFORMER, VAE, SPECIAL_TOKENS, files=(Path(__file__),))
    return build_once(root / key / "Qwen-Image-synthetic", _write_checkpoint, "model_index.json")


def _write_checkpoint(path: Path) -> None:
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = _write_tokenizer(path / "tokenizer")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text = {**TEXT_CONFIG, "vocab_size": len(tokenizer), "eos_token_id": ids["<|im_end|>"]}
    vision_ids = {name: len(tokenizer) + i for i, name in enumerate(("image", "video", "vision_start", "vision_end"))}
    config = Qwen2_5_VLConfig(
        text_config={**text, "pad_token_id": ids["<|endoftext|>"], "bos_token_id": None},
        vision_config=VISION_CONFIG,
        **{f"{name}_token_id": token for name, token in vision_ids.items()},
    )
    encoder = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    encoder.save_pretrained(path / "text_encoder", safe_serialization=True)
    QwenImageTransformer2DModel(**TRANSFORMER).to(torch.bfloat16).save_pretrained(
        path / "transformer", safe_serialization=True
    )
    channels = VAE["z_dim"]
    means, stds = [0.05 * c - 0.4 for c in range(channels)], [1.0 + 0.1 * c for c in range(channels)]
    vae = AutoencoderKLQwenImage(**VAE, latents_mean=means, latents_std=stds)
    vae.save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift_terminal=0.02).save_pretrained(path / "scheduler")
    index = {
        "_class_name": "QwenImagePipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer(path: Path):
    """Byte-level BPE with no merges (every byte a token) and the chat template's special tokens."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {char: i for i, char in enumerate(alphabet)} | {t: len(alphabet) + i for i, t in enumerate(SPECIAL_TOKENS)}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.save_pretrained(path)
    return tokenizer
