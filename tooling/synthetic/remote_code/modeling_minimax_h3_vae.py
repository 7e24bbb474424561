# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The ``auto_map.AutoModel`` class of the synthetic checkpoint: a diffusers model holding the autoencoder."""

from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from .klvae import AutoencoderKL


class MiniMaxH3VideoVAEModel(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(
        self,
        latent_channels: int = 4,
        hidden_channels: int = 32,
        vae_ratio: int = 8,
        temporal_ratio: int = 4,
        vae_clip_length: int = 2,
        vae_tile_size: int = 64,
        vae_tile_overlap_min: int = 16,
        vae_parallel_tiling: int = 1,
    ) -> None:
        super().__init__()
        self.model = AutoencoderKL(
            latent_channels=latent_channels,
            hidden_channels=hidden_channels,
            vae_ratio=vae_ratio,
            temporal_ratio=temporal_ratio,
            clip_length=vae_clip_length,
            tile_size=vae_tile_size,
            tile_overlap_min=vae_tile_overlap_min,
            parallel_tiling=bool(vae_parallel_tiling),
        )

    def decode(self, z):
        return self.model.decode_base(z)
