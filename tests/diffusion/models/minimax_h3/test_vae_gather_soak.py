# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""1,000 requests on four gloo ranks through the released adapter with the fix, mixed geometries in random order.

Every request's frames must equal the stock gather's for the same input; the workspace may grow only when
a larger geometry first appears; the ledger (limit off, so nothing is evicted) must see no registration
after the last growth. Offloads end in a counting stand-in for ``torch.accelerator.empty_cache()``.
"""

from __future__ import annotations

import pytest

from tests.utils import results_or_raise, run_ranks
from tooling.synthetic import build_synthetic_checkpoint

pytestmark = [
    pytest.mark.advanced_model,
    pytest.mark.cpu,
    pytest.mark.diffusion,
    pytest.mark.parallel,
    pytest.mark.slow,
]

WORLD = 4
REQUESTS = 1000
SEED = 1234
LATENT_SIDES = ((16, 16), (16, 24), (24, 24))  # 9, 12 and 16 decoder tiles
DTYPE_NAMES = ("float32", "bfloat16")
VARIANTS = 3  # latents per geometry and dtype


def _soak_on_one_rank(rank: int, world: int, component: str, requests: int) -> dict:
    import math
    import random

    import torch

    from tooling import harness
    from vllm_omni.diffusion.models.minimax_h3.vae_gather import get_tile_gather, install_tile_gather_reuse
    from xpu_collective_memory.ledger import CollectiveLedger

    def workspace_bytes(world: int, num_tiles: int, tile_shape: tuple[int, ...], dtype) -> int:
        """Written out here, not taken from the code under test: a slot per rank for the largest round-robin
        share, each slot rounded up to 128 bytes."""
        share = -(-num_tiles // world) * math.prod(tile_shape) * dtype.itemsize
        return world * -(-share // 128) * 128

    harness.join_vllm_omni_world(rank, world)
    stock, fixed = harness.load_video_vae(component), harness.load_video_vae(component)
    install_tile_gather_reuse(fixed, enabled=True)
    for vae in (stock, fixed):
        vae.set_parallel_size(world)

    inputs = [
        (sides, getattr(torch, dtype), variant)
        for sides in LATENT_SIDES
        for dtype in DTYPE_NAMES
        for variant in range(VARIANTS)
    ]
    latents = [harness.make_latent((1, 4, 2, *sides), seed=i) for i, (sides, _, _) in enumerate(inputs)]

    def serve(vae, index: int) -> str:
        vae.model.tile_dtype = inputs[index][1]
        return harness.digest(harness.run_request(vae, latents[index]))

    order = random.Random(SEED).choices(range(len(inputs)), k=requests)
    tile_shape = (1, 3, 8, fixed.model.tile_size, fixed.model.tile_size)
    growths, largest, needs = 0, 0, []
    for index in order:
        sides, dtype, _ = inputs[index]
        need = workspace_bytes(world, fixed._decoder_tile_count(latents[index]), tile_shape, dtype)
        growths += need > largest
        largest = max(largest, need)
        needs.append(need)

    mismatches, new_registrations = [], []
    with harness.empty_cache_stand_in() as empty_cache_calls:
        expected = [serve(stock, i) for i in range(len(inputs))]
        with CollectiveLedger(limit=None) as ledger:
            for request, index in enumerate(order):
                if serve(fixed, index) != expected[index]:
                    mismatches.append(request)
                new_registrations.append(ledger.end_request().new_registrations)
    return {
        "mismatches": mismatches,
        "new_registrations": new_registrations,
        "registrations": ledger.requests[-1].registrations,
        "expected_growths": growths,
        "last_growth": needs.index(largest),  # the request where the largest geometry first appears
        "largest_need": largest,
        "stats": get_tile_gather(fixed).stats(),
        "empty_cache_calls": len(empty_cache_calls),
        "distinct_inputs_served": len(set(order)),
    }


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    component = str(build_synthetic_checkpoint(tmp_path_factory.mktemp("h3")))
    return results_or_raise(run_ranks(_soak_on_one_rank, WORLD, component, REQUESTS, timeout_s=900), WORLD)


def test_every_request_matches_the_stock_gather_bit_for_bit(reports):
    for report in reports:
        assert report["mismatches"] == []
        assert report["distinct_inputs_served"] == len(LATENT_SIDES) * len(DTYPE_NAMES) * VARIANTS
        assert report["empty_cache_calls"] == REQUESTS + len(LATENT_SIDES) * len(DTYPE_NAMES) * VARIANTS


def test_workspace_grows_only_when_a_larger_geometry_first_appears(reports):
    for report in reports:
        stats = report["stats"]
        assert stats["allocs"] == report["expected_growths"] <= len(LATENT_SIDES) * len(DTYPE_NAMES)
        assert stats["hits"] + stats["allocs"] == REQUESTS
        assert stats["workspace_bytes"] == report["largest_need"]  # no more than the largest geometry needs
        assert len(stats["geometries"]) == len(LATENT_SIDES) * len(DTYPE_NAMES)


def test_registrations_stop_after_the_last_growth(reports):
    for report in reports:
        new = report["new_registrations"]
        assert sum(new) == report["registrations"] == report["stats"]["allocs"] + 1  # + the headers' buffer
        assert all(count == 0 for count in new[report["last_growth"] + 1 :])
