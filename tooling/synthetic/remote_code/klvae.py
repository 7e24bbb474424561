# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""A small video autoencoder that keeps the MiniMax-H3 checkpoint's tiling and gather contract.

Latents decode clip by clip; each clip splits into overlapping spatial tiles; with parallel tiling
rank r decodes tiles ``range(r, num_tiles, sp_size)``, waits at a barrier, gathers every rank's tiles
through ``_all_gather_tiled_results`` and blends them. Encoding tiles pixels the same way.
"""

import math
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn

from .parallel import all_gather_var_shape, get_parallel_state


class VideoProcessor:
    """Maps decoder output in [-1, 1] to frames in [0, 1], as a Normalize(mean=-1, std=2) then a clamp."""

    use_3d_conv = True

    def __init__(self) -> None:
        self.transform_rev = SimpleNamespace(mean=(-1.0, -1.0, -1.0), std=(2.0, 2.0, 2.0))

    def revert_tensor(self, video: torch.Tensor) -> torch.Tensor:
        """``[B, 3, T, H, W]`` in [-1, 1] to ``[(B T), 3, H, W]`` in [0, 1]."""
        mean = torch.tensor(self.transform_rev.mean, dtype=video.dtype, device=video.device).view(1, 3, 1, 1, 1)
        std = torch.tensor(self.transform_rev.std, dtype=video.dtype, device=video.device).view(1, 3, 1, 1, 1)
        frames = ((video - mean) / std).clamp(0.0, 1.0)
        return frames.transpose(1, 2).flatten(0, 1).contiguous()

    @staticmethod
    def to_tensor(video) -> torch.Tensor:
        """``(T, H, W, 3)`` uint8 frames to ``[1, 3, T, H, W]`` float in [-1, 1]."""
        frames = torch.as_tensor(video)
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"expected (T, H, W, 3) frames, got shape {tuple(frames.shape)}")
        return (frames.permute(3, 0, 1, 2).float() / 127.5 - 1.0).unsqueeze(0)


def _blend_ramp(starts: list[int], index: int, size: int) -> torch.Tensor:
    """Weights along one axis: linear ramps over the overlaps with the neighbouring tiles, ones elsewhere."""
    ramp = torch.ones(size)
    if index > 0:
        overlap = starts[index - 1] + size - starts[index]
        if overlap > 0:
            ramp[:overlap] = torch.arange(1, overlap + 1) / (overlap + 1)
    if index + 1 < len(starts):
        overlap = starts[index] + size - starts[index + 1]
        if overlap > 0:
            ramp[size - overlap :] = torch.minimum(ramp[size - overlap :], torch.arange(overlap, 0, -1) / (overlap + 1))
    return ramp


class AutoencoderKL(nn.Module):
    def __init__(
        self,
        latent_channels: int,
        hidden_channels: int,
        vae_ratio: int,
        temporal_ratio: int,
        clip_length: int,
        tile_size: int,
        tile_overlap_min: int,
        parallel_tiling: bool,
    ) -> None:
        super().__init__()
        if tile_size % vae_ratio or tile_overlap_min >= tile_size:
            raise ValueError(f"tile_size={tile_size} must be a multiple of vae_ratio={vae_ratio} above the overlap")
        self.latent_channels = latent_channels
        self.vae_ratio = vae_ratio
        self.temporal_ratio = temporal_ratio
        self.clip_length = clip_length
        self.tile_size = tile_size
        self.tile_overlap_min = tile_overlap_min
        self.parallel_tiling = bool(parallel_tiling)
        # Dtype the decoder hands tiles out in (None: float32); mixed-precision decode sets it.
        self.tile_dtype: torch.dtype | None = None
        self.processor = VideoProcessor()
        patch = 3 * temporal_ratio * vae_ratio * vae_ratio
        self.encoder = nn.Sequential(
            nn.Conv3d(patch, hidden_channels, 1),
            nn.SiLU(),
            nn.Conv3d(hidden_channels, 2 * latent_channels, (1, 3, 3), padding=(0, 1, 1)),
        )
        self.quant_conv = nn.Conv3d(2 * latent_channels, 2 * latent_channels, 1)
        self.post_quant_conv = nn.Conv3d(latent_channels, latent_channels, 1)
        self.decoder = nn.Sequential(
            nn.Conv3d(latent_channels, hidden_channels, (1, 3, 3), padding=(0, 1, 1)),
            nn.SiLU(),
            nn.Conv3d(hidden_channels, patch, 1),
        )

    def split_tiles(self, length: int, is_decoder: bool) -> tuple[list[int], int, int]:
        """Tile starts along one pixel axis, the tile size and the minimum overlap.

        Starts are spread evenly and aligned to the latent grid; an axis no longer than a tile is one tile.
        """
        del is_decoder  # encoder and decoder tile alike here
        if length <= self.tile_size:
            return [0], length, 0
        count = math.ceil((length - self.tile_overlap_min) / (self.tile_size - self.tile_overlap_min))
        span = (length - self.tile_size) // self.vae_ratio
        starts = [round(i * span / (count - 1)) * self.vae_ratio for i in range(count)]
        return starts, self.tile_size, self.tile_overlap_min

    def _grid(self, height: int, width: int, is_decoder: bool) -> tuple[list[tuple[int, int]], int, int, list, list]:
        rows, tile_h, _ = self.split_tiles(height, is_decoder)
        cols, tile_w, _ = self.split_tiles(width, is_decoder)
        return [(y, x) for y in rows for x in cols], tile_h, tile_w, rows, cols

    def _run_tiles(self, work, num_tiles: int) -> list[torch.Tensor]:
        """Every tile, decoded here or shared round-robin across the spatial-parallel group."""
        state = get_parallel_state()
        if not (self.parallel_tiling and state["sp_enabled"] and state["sp_size"] > 1):
            return [work(i) for i in range(num_tiles)]
        tasks = [work(i) for i in range(state["sp_rank"], num_tiles, state["sp_size"])]
        dist.barrier(group=state["sp_process_group"])
        return self._all_gather_tiled_results(tasks, num_tiles)

    def _all_gather_tiled_results(self, tasks: list[torch.Tensor], num_tiles: int) -> list[torch.Tensor]:
        state = get_parallel_state()
        sp_size, sp_rank = state["sp_size"], state["sp_rank"]
        if len(tasks) == 0:
            raise ValueError(f"Found empty tasks on sp rank {sp_rank}")
        shares = all_gather_var_shape(torch.stack(tasks, dim=0), state["sp_process_group"])
        results: list[torch.Tensor] = [None] * num_tiles
        for rank, share in enumerate(shares):
            for k in range(share.shape[0]):
                results[k * sp_size + rank] = share[k]
        return results

    @staticmethod
    def _blend(tiles, coords, rows, cols, tile_h, tile_w, out_shape) -> torch.Tensor:
        out = torch.zeros(out_shape, dtype=torch.float32, device=tiles[0].device)
        weight = torch.zeros(out_shape[-2:], dtype=torch.float32, device=tiles[0].device)
        for tile, (y, x) in zip(tiles, coords, strict=True):
            w = torch.outer(_blend_ramp(rows, rows.index(y), tile_h), _blend_ramp(cols, cols.index(x), tile_w))
            w = w.to(out.device)
            out[..., y : y + tile_h, x : x + tile_w] += tile.float() * w
            weight[y : y + tile_h, x : x + tile_w] += w
        return out / weight

    def _decode_patch(self, z: torch.Tensor) -> torch.Tensor:
        r, tr = self.vae_ratio, self.temporal_ratio
        x = self.decoder(self.post_quant_conv(z))
        b, _, t, h, w = x.shape
        x = x.view(b, 3, tr, r, r, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
        return x.reshape(b, 3, t * tr, h * r, w * r)

    def tiled_decode(self, z: torch.Tensor) -> torch.Tensor:
        """One temporal clip of latents ``[B, C, t, h, w]`` to pixels ``[B, 3, t * tr, h * r, w * r]``."""
        r = self.vae_ratio
        height, width = z.shape[-2] * r, z.shape[-1] * r
        coords, tile_h, tile_w, rows, cols = self._grid(height, width, True)

        def work(i: int) -> torch.Tensor:
            y, x = coords[i]
            tile = self._decode_patch(z[..., y // r : (y + tile_h) // r, x // r : (x + tile_w) // r])
            return tile.to(self.tile_dtype or torch.float32)

        tiles = self._run_tiles(work, len(coords))
        out_shape = (z.shape[0], 3, z.shape[2] * self.temporal_ratio, height, width)
        return self._blend(tiles, coords, rows, cols, tile_h, tile_w, out_shape)

    def decode_base(self, z: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, T, h, w]`` to pixels in [-1, 1], ``clip_length`` latent frames at a time."""
        clips = [self.tiled_decode(clip) for clip in z.split(self.clip_length, dim=2)]
        return torch.cat(clips, dim=2)

    def _encode_patch(self, x: torch.Tensor) -> torch.Tensor:
        r, tr = self.vae_ratio, self.temporal_ratio
        b, c, t, h, w = x.shape
        x = x.reshape(b, c, t // tr, tr, h // r, r, w // r, r).permute(0, 1, 3, 5, 7, 2, 4, 6)
        moments = self.quant_conv(self.encoder(x.reshape(b, c * tr * r * r, t // tr, h // r, w // r)))
        return moments[:, : self.latent_channels]

    def tiled_encode(self, x: torch.Tensor) -> torch.Tensor:
        """One temporal clip of pixels ``[B, 3, T, H, W]`` to latent means ``[B, C, T / tr, H / r, W / r]``."""
        r = self.vae_ratio
        coords, tile_h, tile_w, rows, cols = self._grid(x.shape[-2], x.shape[-1], False)

        def work(i: int) -> torch.Tensor:
            y, xx = coords[i]
            return self._encode_patch(x[..., y : y + tile_h, xx : xx + tile_w])

        tiles = self._run_tiles(work, len(coords))
        out_shape = (
            x.shape[0],
            self.latent_channels,
            x.shape[2] // self.temporal_ratio,
            x.shape[-2] // r,
            x.shape[-1] // r,
        )
        latent_rows, latent_cols = [y // r for y in rows], [c // r for c in cols]
        latent_coords = [(y // r, xx // r) for y, xx in coords]
        return self._blend(tiles, latent_coords, latent_rows, latent_cols, tile_h // r, tile_w // r, out_shape)

    def encode_videos(self, videos, use_fp16_latent: bool = False) -> list[torch.Tensor]:
        """Each ``(T, H, W, 3)`` uint8 video to its latent ``[C, T / tr, H / r, W / r]``."""
        if not isinstance(videos, (list, tuple)):
            videos = [videos]
        device = next(self.parameters()).device
        latents = []
        for video in videos:
            x = self.processor.to_tensor(video).to(device)
            t, h, w = x.shape[2:]
            if t % self.temporal_ratio or h % self.vae_ratio or w % self.vae_ratio:
                raise ValueError(
                    f"video of {t} frames at {h}x{w} must have frames divisible by {self.temporal_ratio} "
                    f"and sides divisible by {self.vae_ratio}"
                )
            clips = x.split(self.clip_length * self.temporal_ratio, dim=2)
            latent = torch.cat([self.tiled_encode(clip) for clip in clips], dim=2)[0]
            latents.append(latent.half() if use_fp16_latent else latent)
        return latents
