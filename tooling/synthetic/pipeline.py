# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""A whole MiniMax-H3 pipeline checkpoint, tiny and random, in the layout vLLM-Omni 0.28.0 and 0.30.0 load.

The real configs' structure with small widths: every component goes through vLLM-Omni's own loader (the
DiT and the Qwen3-VL text encoder through ``load_weights``, the VAEs through their remote code). Fixed by
the pipeline, and kept: 24 video and 32 audio latent channels, a 16x spatial VAE, (1, 2, 2) patches and the
text encoder's 5120-wide hidden states. The directory is named ``FL2VA``: vLLM-Omni reads the partition
(t2va and fl2va tasks) from it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from . import REMOTE_CODE, build_once, default_cache_dir, fingerprint, write_video_vae

AUDIO_REMOTE_FILE = "modeling_minimax_h3_audio_vae.py"
TEXT_WIDTH = 5120  # MINIMAX_H3_QWEN3VL_HIDDEN_DIM in vLLM-Omni's encoder: not configurable
VIDEO_VAE = {
    "latent_channels": 24,
    "hidden_channels": 16,
    "vae_ratio": 16,
    "temporal_ratio": 4,
    "vae_clip_length": 8,
    "vae_tile_size": 64,
    "vae_tile_overlap_min": 16,
    "vae_parallel_tiling": 1,
}
DIT = {
    "num_layers": 1,
    "token_refiner_num_layers": 1,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "attention_head_dim": 16,
    "ffn_hidden_size": 128,
    "latents_dim": 24,
    "audio_latents_dim": 32,
    "patch_size": [1, 2, 2],
    "text_dim": TEXT_WIDTH,
    "timestep_input_dim": 32,
    "time_embed_hidden_size": 64,
    "time_embed_dim": 32,
    "adaln_out_features": 18 * 64,
    "final_adaln_out_features": 2 * 64,
    "rope_inv_freq_len": 2,
    "norm_eps": 1e-5,
    "qk_norm_eps": 1e-5,
    "final_norm_eps": 1e-5,
}
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Request geometry that tiles into 2x2 decoder tiles of 64 px, so patch parallel 4 gathers every clip;
# 96 frames at 24 fps is the 4 s minimum the pipeline accepts (it rounds up to 107 frames).
REQUEST = {"height": 96, "width": 96, "num_frames": 96, "fps": 24, "num_inference_steps": 2, "aspect_ratio": "1:1"}
# 107 frames are 32 latent frames (the pipeline's 17n+5 frames <-> 5n+2 latents), decoded in clips of 8.
GATHERS_PER_REQUEST = 32 // VIDEO_VAE["vae_clip_length"]


def build_synthetic_pipeline(cache_dir: str | os.PathLike | None = None) -> Path:
    """Write the pipeline once per content fingerprint; returns its ``FL2VA`` directory."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = fingerprint(VIDEO_VAE, DIT, SPECIAL_TOKENS, files=(Path(__file__), REMOTE_CODE / AUDIO_REMOTE_FILE))
    return build_once(root / key / "FL2VA", _write_pipeline, "model_index.json")


def _write_pipeline(path: Path) -> None:
    tokenizer = _write_tokenizer(path / "tokenizer")
    _write_processor(path / "processor", tokenizer)
    _write_text_encoder(path / "text_encoder", tokenizer)
    _write_transformer(path / "transformer")
    write_video_vae(path / "video_vae", VIDEO_VAE)
    _write_audio_vae(path / "audio_vae")
    index = {
        "_class_name": "MiniMaxH3Pipeline",
        "_minimax_h3": {"partition": "fl2va", "tasks": ["t2va", "fl2va"]},
        "transformer": ["diffusers", "MiniMaxH3DiTModel"],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "processor": ["transformers", "Qwen3VLProcessor"],
        "video_vae": ["diffusers", "MiniMaxH3VideoVAEModel"],
        "audio_vae": ["diffusers", "MiniMaxH3AudioVAEModel"],
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer(path: Path):
    """A byte-level BPE tokenizer with no merges: every byte is a token, plus Qwen's chat and vision tokens."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {"<|endoftext|>": 0} | {char: i + 1 for i, char in enumerate(sorted(ByteLevel.alphabet()))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_tokens(list(SPECIAL_TOKENS), special_tokens=True)
    tokenizer.save_pretrained(path)
    return tokenizer


def _write_processor(path: Path, tokenizer) -> None:
    tokenizer.save_pretrained(path)
    vision = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3}
    vision["image_std"] = [0.5] * 3
    config = {
        "processor_class": "Qwen3VLProcessor",
        "image_processor": {
            "image_processor_type": "Qwen2VLImageProcessor",
            "size": {"shortest_edge": 1024, "longest_edge": 1048576},
            **vision,
        },
        "video_processor": {
            "video_processor_type": "Qwen3VLVideoProcessor",
            "size": {"shortest_edge": 4096, "longest_edge": 786432},
            **vision,
        },
    }
    (path / "processor_config.json").write_text(json.dumps(config, indent=2))


def _write_text_encoder(path: Path, tokenizer) -> None:
    """Qwen3-VL with one text layer and one vision block; the text and vision outputs stay 5120 wide."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": -(-len(tokenizer) // 8) * 8,
            "hidden_size": TEXT_WIDTH,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 16,  # mrope_section sums to head_dim / 2
            "rms_norm_eps": 1e-6,
            "rope_parameters": rope,
            "max_position_embeddings": 4096,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": TEXT_WIDTH,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = Qwen3VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)


def _write_transformer(path: Path) -> None:
    """The DiT's weights under the names its ``load_weights`` maps; fp32 where vLLM-Omni keeps fp32."""
    from safetensors.torch import save_file

    hidden, heads, head_dim = DIT["hidden_size"], DIT["num_attention_heads"], DIT["attention_head_dim"]
    ffn, time_hidden, time_dim = DIT["ffn_hidden_size"], DIT["time_embed_hidden_size"], DIT["time_embed_dim"]
    video_patch = DIT["latents_dim"] * 4  # (1, 2, 2) patches
    weights: dict[str, torch.Tensor] = {}

    def linear(name: str, out: int, inp: int, dtype=torch.bfloat16, bias: bool = True) -> None:
        weights[f"{name}.weight"] = (torch.randn(out, inp) * 0.02).to(dtype)
        if bias:
            weights[f"{name}.bias"] = (torch.randn(out) * 0.02).to(dtype)

    def norm(name: str, width: int = hidden) -> None:
        weights[f"{name}.weight"] = torch.ones(width, dtype=torch.bfloat16)

    def block(prefix: str, adaln: bool) -> None:
        norm(f"{prefix}.norm1")
        norm(f"{prefix}.norm2")
        linear(f"{prefix}.attn.qkv_proj", 3 * heads * head_dim, hidden, bias=False)  # per head: q, k, v
        norm(f"{prefix}.attn.q_norm", head_dim)
        norm(f"{prefix}.attn.k_norm", head_dim)
        linear(f"{prefix}.attn.out_proj", hidden, heads * head_dim, bias=False)
        linear(f"{prefix}.mlp.fc1", 2 * ffn, hidden, bias=False)  # gate, then up
        linear(f"{prefix}.mlp.fc2", hidden, ffn, bias=False)
        if adaln:
            linear(f"{prefix}.adaln_proj.linear", DIT["adaln_out_features"], time_dim)

    linear("video_patch_proj", hidden, video_patch, torch.float32)
    linear("audio_patch_proj", hidden, DIT["audio_latents_dim"], torch.float32)
    linear("condition_proj", hidden, TEXT_WIDTH)
    linear("time_embedder.proj_in", time_hidden, DIT["timestep_input_dim"], torch.float32)
    linear("time_embedder.proj_out", time_dim, time_hidden, torch.float32)
    freqs = DIT["rope_inv_freq_len"]
    weights["rope.inv_freq"] = 1e4 ** (-torch.arange(0, 2 * freqs, 2, dtype=torch.float32) / (2 * freqs))
    for i in range(DIT["token_refiner_num_layers"]):
        block(f"token_refiner.blocks.{i}", adaln=False)
    norm("token_refiner.final_norm")
    for i in range(DIT["num_layers"]):
        block(f"blocks.{i}", adaln=True)
    norm("final_layer.norm")
    linear("final_layer.adaln_proj.linear", DIT["final_adaln_out_features"], time_dim)
    linear("final_layer.video_out", video_patch, hidden, torch.float32)
    linear("final_layer.audio_out", DIT["audio_latents_dim"], hidden, torch.float32)

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"_class_name": "MiniMaxH3DiTModel", **DIT}, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "diffusion_pytorch_model.safetensors"))


def _write_audio_vae(path: Path) -> None:
    from .remote_code.modeling_minimax_h3_audio_vae import MiniMaxH3AudioVAEModel

    model = MiniMaxH3AudioVAEModel()
    model.save_pretrained(path, safe_serialization=True)
    config = json.loads((path / "config.json").read_text())
    channels = model.config.latent_channels
    config.update(
        auto_map={"AutoModel": f"{AUDIO_REMOTE_FILE.removesuffix('.py')}.MiniMaxH3AudioVAEModel"},
        latents_mean=[0.05 * c for c in range(channels)],
        latents_std=[1.0 + 0.01 * c for c in range(channels)],
    )
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    shutil.copyfile(REMOTE_CODE / AUDIO_REMOTE_FILE, path / AUDIO_REMOTE_FILE)
