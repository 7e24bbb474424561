# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The reviewed reason for every collective call site of vLLM-Omni's diffusion tree that is not routed, and for
routed ones that stay plain at run time: load-time calls (under ``DiffusionWorker.load_model``, where collectives are
``unstaged``) and control calls (a coordinator's gloo ``cpu_group``, never staged). Those keep no block.

Keyed by (path under ``vllm_omni/diffusion``, enclosing function, collective), so that a line moving in a release
keeps its entry and a new site fails ``python -m xpu_collective_memory.reach`` until it is routed or reviewed here.
The sites of both supported releases (0.28.0, 0.30.0) are listed.
"""

from __future__ import annotations

from typing import Literal

Status = Literal["routed", "load", "control", "unreachable", "outside", "request", "unknown"]
FAILING = frozenset({"request", "unknown"})  # a request-path site left fresh, or one nobody reviewed

_GLOO = "on the coordinator's gloo cpu_group, CPU tensors: plain, keeps no block"

REASONS: dict[tuple[str, str, str], tuple[Status, str]] = {
    ("cancellation.py", "check_request_cancellation", "all_reduce"): ("control", "an int32 flag " + _GLOO),
    ("distributed/group_coordinator.py", "GroupCoordinator.broadcast_object", "broadcast_object_list"): (
        "control",
        "a pickled object " + _GLOO,
    ),
    ("distributed/group_coordinator.py", "GroupCoordinator.send_object", "send"): ("control", "size, pickle " + _GLOO),
    ("distributed/group_coordinator.py", "GroupCoordinator.recv_object", "recv"): ("control", "size, pickle " + _GLOO),
    ("distributed/group_coordinator.py", "GroupCoordinator.broadcast_tensor_dict", "broadcast_object"): (
        "control",
        "the dict's metadata " + _GLOO,
    ),
    ("distributed/group_coordinator.py", "GroupCoordinator.isend_tensor_dict", "send_object"): (
        "control",
        "the dict's metadata " + _GLOO,
    ),
    ("distributed/group_coordinator.py", "GroupCoordinator.irecv_tensor_dict", "recv_object"): (
        "control",
        "the dict's metadata " + _GLOO,
    ),
    ("interaction/types.py", "synchronized_monotonic_time", "broadcast_object"): ("control", "a float " + _GLOO),
    ("layers/fused_moe.py", "_set_forward_context_dp_metadata", "all_gather_object"): (
        "control",
        "token counts on vLLM's data-parallel gloo group",
    ),
    ("worker/diffusion_worker.py", "_all_gather_rank_values", "all_gather_object"): (
        "control",
        "start-up values; 0.30.0 on the world gloo group, 0.28.0 once at start-up",
    ),
    ("model_loader/diffusers_loader.py", "DiffusersPipelineLoader._broadcast_model_weights", "broadcast"): (
        "load",
        "the bucketed weight broadcast, under DiffusionWorker.load_model: plain, keeps no block",
    ),
    ("model_loader/diffusers_loader.py", "DiffusersPipelineLoader._broadcast_model_weights", "barrier"): (
        "load",
        "after the weight broadcast, under DiffusionWorker.load_model: plain",
    ),
    ("distributed/group_coordinator.py", "GroupCoordinator.gather", "gather"): (
        "unreachable",
        "no caller in the tree (vLLM's logits processor gathers with all_gather on every platform but TPU)",
    ),
    ("models/wan2_2/pipeline_wan2_2_s2v.py", "Wan22S2VPipeline.forward", "broadcast"): (
        "unreachable",
        "only under a VAE group (self.vae._vae_pp_group) that nothing in 0.28.0 or 0.30.0 sets",
    ),
    ("distributed/vae_patch_parallel.py", "_distributed_tiled_decode", "gather"): (
        "unreachable",
        "vae_patch_parallel is imported by nothing in 0.28.0 or 0.30.0",
    ),
    ("distributed/vae_patch_parallel.py", "_distributed_patch_decode", "gather"): (
        "unreachable",
        "vae_patch_parallel is imported by nothing in 0.28.0 or 0.30.0",
    ),
}
