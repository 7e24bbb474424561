# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""``torch.distributed`` for the request path's modules: synchronous tensor collectives through the platform's;
with persistent blocks, object collectives on the gloo group over the same ranks, as the worker's own are. Traced,
an even all-to-all goes through the op ``vllm_omni::all_to_all`` and a point-to-point batch runs eagerly. Any other
name or call (``async_op=True``, other traced calls, uneven or non-contiguous list gathers) is ``torch.distributed``'s
own.
"""

from __future__ import annotations

import torch
import torch.distributed as _dist

from .persistent_collectives import cpu_twin, platform_collectives


def __getattr__(name: str):
    return getattr(_dist, name)


def _plain(async_op: bool) -> bool:
    return async_op or torch.compiler.is_compiling()


def all_reduce(tensor, op=_dist.ReduceOp.SUM, group=None, async_op=False):
    if _plain(async_op):
        return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    platform_collectives().all_reduce(tensor, group, op)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    if _plain(async_op) or src is None or group_src is not None:
        return _dist.broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)
    platform_collectives().broadcast(tensor, src, group)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    even = all(t.shape == tensor.shape and t.dtype == tensor.dtype and t.is_contiguous() for t in tensor_list)
    if _plain(async_op) or not even:
        return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    platform_collectives().all_gather_into_tensor(tensor_list, tensor, group)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    even = output_split_sizes is None and input_split_sizes is None
    if torch.compiler.is_compiling() and even and not async_op:  # traced: the registered op stages it when run
        group_name = (group if group is not None else _dist.group.WORLD).group_name
        output.copy_(torch.ops.vllm_omni.all_to_all(input.contiguous(), group_name))
        return None
    if _plain(async_op) or not (output.is_contiguous() and input.is_contiguous()):
        return _dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group, async_op)
    platform_collectives().all_to_all_single(output, input, group, output_split_sizes, input_split_sizes)


@torch.compiler.disable  # Dynamo breaks the graph at a batch anyway; run eagerly, it is staged
def batch_isend_irecv(p2p_op_list):
    return platform_collectives().batch_isend_irecv(p2p_op_list)


def barrier(group=None, async_op=False, device_ids=None, timeout=None):
    from vllm_omni.platforms import current_omni_platform

    collectives, device = platform_collectives(), current_omni_platform.get_torch_device()
    gloo_on_a_device = device.type != "cpu" and _dist.get_backend(group) == "gloo"  # no device tensors there
    if _plain(async_op) or timeout is not None or not collectives.staged or gloo_on_a_device:
        return _dist.barrier(group=group, async_op=async_op, device_ids=device_ids, timeout=timeout)
    collectives.barrier(group, device)


def _object_group(group):
    twin = cpu_twin(group) if platform_collectives().staged else None
    return group if twin is None else twin


def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
    on = _object_group(group)
    return _dist.broadcast_object_list(object_list, src, on, device if on is group else None, group_src)


def all_gather_object(object_list, obj, group=None):
    return _dist.all_gather_object(object_list, obj, group=_object_group(group))
