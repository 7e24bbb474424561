# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The fix inside the released MiniMaxH3VideoVAE adapter, on four gloo ranks, through the plugin.

The adapter loads the synthetic checkpoint with transformers' dynamic-module loader, as it loads the real
one. Each request loads the VAE, decodes and offloads; the offload's ``torch.accelerator.empty_cache()``
raises on a CPU-only torch, so a counting stand-in replaces that one call (``empty_cache_stand_in``).
"""

from __future__ import annotations

import pytest

from tests.utils import results_or_raise, run_ranks
from tooling.synthetic import build_synthetic_checkpoint

pytestmark = [
    pytest.mark.core_model,
    pytest.mark.cpu,
    pytest.mark.diffusion,
    pytest.mark.parallel,
    pytest.mark.integration,
]

WORLD = 4
REQUESTS = 3
# Latent [B, C, T, h, w]: 28 tiles (the canonical 4x7 grid), 12 tiles, and 12 tiles over three temporal clips.
LATENTS = {"192x336": (1, 4, 2, 24, 42), "128x192": (1, 4, 2, 16, 24), "128x192-3clips": (1, 4, 5, 16, 24)}
VIDEO = (8, 128, 192)  # frames, height, width: 12 encoder tiles
GATHERS_PER_REQUEST = 1 + 1 + 3 + 1


def _requests_on_one_rank(rank: int, world: int, component: str) -> dict:
    import os

    import numpy as np

    from tooling import harness
    from vllm_omni.diffusion.models.minimax_h3.vae import MiniMaxH3VideoVAE
    from vllm_omni.diffusion.models.minimax_h3.vae_gather import REUSE_ENV, get_tile_gather, remove_tile_gather_reuse
    from vllm_omni.plugins import load_omni_general_plugins

    os.environ.pop("VLLM_PLUGINS", None)
    os.environ.pop(REUSE_ENV, None)
    harness.join_vllm_omni_world(rank, world)
    load_omni_general_plugins()

    report: dict = {}
    vae_off = harness.load_video_vae(component)  # auto mode on CPU: the checkpoint's own gather
    report["off_installed"] = get_tile_gather(vae_off) is not None
    os.environ[REUSE_ENV] = "1"
    vae_on = harness.load_video_vae(component)
    report["on_installed"] = get_tile_gather(vae_on) is not None
    for vae in (vae_off, vae_on):
        vae.set_parallel_size(world)

    rng = np.random.default_rng(7)
    video = rng.integers(0, 256, size=(*VIDEO, 3), dtype=np.uint8)
    report["decode"] = {name: [] for name in LATENTS}
    report["encode"] = []
    with harness.empty_cache_stand_in() as empty_cache_calls:
        for request in range(REQUESTS):
            for index, (name, shape) in enumerate(LATENTS.items()):
                latent = harness.make_latent(shape, seed=100 * request + index)
                off, on = (harness.digest(harness.run_request(vae, latent)) for vae in (vae_off, vae_on))
                report["decode"][name].append((off, on))
            encoded = []
            for vae in (vae_off, vae_on):
                vae.load_to_device()
                rows, latent_shape = vae.encode_video(video)
                vae.offload_to_cpu()
                encoded.append((harness.digest(rows), latent_shape))
            report["encode"].append(tuple(encoded))
    report["empty_cache_calls"] = len(empty_cache_calls)
    report["stats"] = get_tile_gather(vae_on).stats()

    if hasattr(MiniMaxH3VideoVAE, "_install_persistent_tile_gather"):
        # vllm-omni 0.30.0 binds its own receive-side override on XPU; claim XPU for it (a stand-in: no card here).
        MiniMaxH3VideoVAE._tile_gather_reuse_enabled = lambda self: True
        vae = harness.load_video_vae(component)
        vae.set_parallel_size(world)
        override = vars(vae.model).get("_all_gather_tiled_results")
        with harness.empty_cache_stand_in():
            frames = harness.run_request(vae, harness.make_latent(LATENTS["192x336"], seed=0))
        report["upstream"] = {
            "ours_is_the_override": override is get_tile_gather(vae),
            "ours_ran": get_tile_gather(vae).stats()["allocs"] + get_tile_gather(vae).stats()["hits"],
            "upstream_ran": vae._tile_gather_stats["allocs"] + vae._tile_gather_stats["hits"],
            "frames": harness.digest(frames),
        }
        remove_tile_gather_reuse(vae)
        restored = vae.model._all_gather_tiled_results
        report["upstream"]["restored_checkpoint_method"] = (
            "_all_gather_tiled_results" not in vars(vae.model)
            and restored.__func__ is type(vae.model)._all_gather_tiled_results
        )
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    component = build_synthetic_checkpoint(tmp_path_factory.mktemp("h3"))
    return results_or_raise(run_ranks(_requests_on_one_rank, WORLD, str(component), timeout_s=600), WORLD)


def test_plugin_installs_the_fix_only_where_asked_on_cpu(reports):
    assert all(not r["off_installed"] and r["on_installed"] for r in reports)


@pytest.mark.parametrize("geometry", LATENTS)
def test_decoded_frames_are_bit_identical_with_the_fix_on_and_off_over_requests(reports, geometry):
    for rank, report in enumerate(reports):
        pairs = report["decode"][geometry]
        assert len(pairs) == REQUESTS
        assert all(off == on for off, on in pairs), f"rank {rank}"
        assert pairs == reports[0]["decode"][geometry]  # and every rank holds the same video
    # Different requests decode different latents: the digests would notice a stale result.
    assert len({on for _, on in reports[0]["decode"][geometry]}) == REQUESTS


def test_encoded_latents_are_bit_identical_with_the_fix_on_and_off(reports):
    for report in reports:
        assert all(off == on for off, on in report["encode"])
        assert report["encode"] == reports[0]["encode"]


def test_every_gather_of_every_request_went_through_one_workspace(reports):
    for report in reports:
        stats = report["stats"]
        assert stats["allocs"] == 1  # the largest geometry (28 tiles) comes first
        assert stats["hits"] + stats["allocs"] == REQUESTS * GATHERS_PER_REQUEST
        assert report["empty_cache_calls"] == 2 * REQUESTS * (len(LATENTS) + 1)


def test_on_vllm_omni_0_30_ours_is_the_only_override_and_removal_restores_the_checkpoint(reports):
    if "upstream" not in reports[0]:
        pytest.skip("this vllm-omni has no adapter-level gather override of its own (before 0.30.0)")
    for report in reports:
        upstream = report["upstream"]
        assert upstream["ours_is_the_override"]
        assert upstream["ours_ran"] == 1 and upstream["upstream_ran"] == 0
        assert upstream["frames"] == report["decode"]["192x336"][0][0]
        assert upstream["restored_checkpoint_method"]
