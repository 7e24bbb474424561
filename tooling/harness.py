# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Drive the released MiniMax-H3 video VAE adapter the way a serving worker does, on any device.

Shared by the integration tests and the benchmark: load the adapter, join vLLM-Omni's distributed
environment, run one request (load, decode, offload), and fingerprint its frames.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch


def load_video_vae(component_path: str, device: torch.device | str = "cpu") -> Any:
    """The released adapter on a component directory; 0.30.0 and later also need remote code trusted."""
    from vllm_omni.diffusion.models.minimax_h3.vae import MiniMaxH3VideoVAE

    kwargs: dict[str, Any] = {"device": torch.device(device)}
    if "trust_remote_code" in inspect.signature(MiniMaxH3VideoVAE.__init__).parameters:
        kwargs["trust_remote_code"] = True
    return MiniMaxH3VideoVAE(str(component_path), **kwargs)


def join_vllm_omni_world(rank: int, world_size: int) -> None:
    """vLLM-Omni's world group over an already initialised ``torch.distributed``.

    vLLM-Omni's ``init_distributed_environment`` divides by the device count when it creates the process
    group, which fails on a machine without accelerators; with the group already up it only builds its own.
    """
    import torch.distributed as dist

    from vllm_omni.diffusion.distributed.parallel_state import init_distributed_environment

    if not dist.is_initialized():
        raise RuntimeError("initialise torch.distributed before joining vLLM-Omni's world group")
    init_distributed_environment(
        world_size=world_size,
        rank=rank,
        distributed_init_method="env://",
        local_rank=rank,
        backend=dist.get_backend(),
    )


@contextlib.contextmanager
def empty_cache_stand_in() -> Iterator[list[int]]:
    """On a CPU-only torch, stand in for ``torch.accelerator.empty_cache`` (it raises without a device).

    The adapter's offload ends in that call; here it only counts, so a CPU run can offload as serving does.
    With an accelerator present the real call runs and nothing is replaced.
    """
    calls: list[int] = []
    if torch.accelerator.is_available():
        yield calls
        return
    original = torch.accelerator.empty_cache
    torch.accelerator.empty_cache = lambda: calls.append(1)
    try:
        yield calls
    finally:
        torch.accelerator.empty_cache = original


def run_request(vae: Any, latent: torch.Tensor) -> torch.Tensor:
    """One request under model-level offload: load the VAE, decode, offload (which empties the cache)."""
    vae.load_to_device()
    try:
        return vae.decode_latent(latent.to(vae._device_target))
    finally:
        vae.offload_to_cpu()


def make_latent(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def digest(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's bytes, dtype and shape: equal digests mean bit-identical tensors."""
    data = tensor.detach().cpu().contiguous()
    header = f"{data.dtype}{tuple(data.shape)}".encode()
    return hashlib.sha256(header + data.view(torch.uint8).numpy().tobytes()).hexdigest()
