# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The synthetic checkpoint's audio VAE: the interface MiniMaxH3AudioVAE calls, on a small 1-D convolution pair.

``decode`` maps latents ``[channels, 32, frames]`` to waveforms ``[channels, 1, frames * hop_length]``; the
encoder side (``preprocess``, ``encoder``, ``pre_block``, ``mean_proj``) exists because the adapter reaches
for it when it encodes reference audio and when it drops the encoder in decode-only mode.
"""

import torch
import torch.nn as nn
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config


class AudioAutoencoder(nn.Module):
    def __init__(self, latent_channels: int, hidden_channels: int, hop_length: int) -> None:
        super().__init__()
        self.attn_proj = False
        self.encoder = nn.Sequential(nn.Conv1d(1, hidden_channels, hop_length, stride=hop_length), nn.SiLU())
        self.pre_block = nn.Identity()
        self.mean_proj = nn.Conv1d(hidden_channels, latent_channels, 1)
        self.decoder = nn.Sequential(
            nn.Conv1d(latent_channels, hidden_channels, 3, padding=1),
            nn.SiLU(),
            nn.ConvTranspose1d(hidden_channels, 1, hop_length, stride=hop_length),
        )

    def preprocess(self, audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
        return audio

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.decoder(latents))


class MiniMaxH3AudioVAEModel(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(
        self, latent_channels: int = 32, hidden_channels: int = 16, hop_length: int = 800, sample_rate: int = 32000
    ) -> None:
        super().__init__()
        self.model = AudioAutoencoder(latent_channels, hidden_channels, hop_length)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.model.decode(latents)
