# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The checkpoint's own collectives (its per-clip barrier) go through vLLM-Omni's managed namespace, and only its.

Four gloo ranks load the synthetic checkpoint through the released adapter (the plugin scopes it) and decode three
temporal clips, one barrier each; a test-only recorder sees what ``torch.distributed`` hands the backend.
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
LATENT = (1, 4, 5, 16, 24)  # three temporal clips of 12 tiles, a barrier before each clip's gather


def _decode_twice(rank: int, world: int, component: str) -> dict:
    import os
    import sys

    import torch.distributed as dist

    from tests.distributed.collective_ranks import BackendRecorder
    from tooling import harness
    from vllm_omni.diffusion.models.minimax_h3.vae_gather import REUSE_ENV
    from vllm_omni.distributed import managed_distributed
    from vllm_omni.distributed.persistent_collectives import SWITCH_ENV
    from vllm_omni.plugins import load_omni_general_plugins

    os.environ.pop("VLLM_PLUGINS", None)
    os.environ[REUSE_ENV] = "1"
    os.environ[SWITCH_ENV] = "1"  # a process that stages: the plugin scopes the checkpoint's code as it loads
    harness.join_vllm_omni_world(rank, world)
    torch_barrier = dist.barrier
    load_omni_general_plugins()
    vae = harness.load_video_vae(component)
    vae.set_parallel_size(world)
    package = type(vae.model).__module__.rpartition(".")[0]
    scoped = sorted(n for n, m in sys.modules.items() if n.startswith(package) and vars(m).get("dist") is not None)
    report = {
        "scoped": {name: sys.modules[name].dist is managed_distributed for name in scoped},
        "torch_barrier_untouched": dist.barrier is torch_barrier,
    }
    for switch in ("0", "1"):
        os.environ[SWITCH_ENV] = switch
        recorders = []
        with harness.empty_cache_stand_in():
            for request in range(2):
                with BackendRecorder() as recorder:
                    frames = harness.run_request(vae, harness.make_latent(LATENT, seed=request))
                recorders.append(recorder)
        report[switch] = {
            "barriers": [sum(name == "barrier" for name, _ in r.requests[0]) for r in recorders],
            "unmanaged": [r.summary()[0]["unmanaged"] for r in recorders],
            "fresh_in_request_2": BackendRecorder.fresh_across(recorders),
            "frames": harness.digest(frames),
        }
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    component = str(build_synthetic_checkpoint(tmp_path_factory.mktemp("h3")))
    return results_or_raise(run_ranks(_decode_twice, WORLD, component, timeout_s=600), WORLD)


def test_only_the_checkpoints_own_modules_get_the_managed_namespace(reports):
    for report in reports:
        assert report["scoped"] and all(report["scoped"].values()), report["scoped"]
        assert report["torch_barrier_untouched"]


def test_with_persistent_collectives_the_checkpoints_barrier_hands_the_backend_no_new_buffer(reports):
    for report in reports:
        assert report["1"]["barriers"] == [0, 0] and report["1"]["unmanaged"] == [0, 0]
        assert report["1"]["fresh_in_request_2"] == 0


def test_without_them_the_checkpoint_runs_its_barrier_as_released(reports):
    for report in reports:
        assert report["0"]["barriers"] == [3, 3]  # one per temporal clip, each request


def test_the_frames_are_the_same_either_way(reports):
    for report in reports:
        assert report["0"]["frames"] == report["1"]["frames"]
