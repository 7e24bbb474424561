# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""``torch.distributed`` for the request path's modules. In a process that does not stage, each function is torch's
own call, eager and compiled, as upstream's code makes it. Staging, tensor collectives go through the platform's,
eager, and through the ops of ``traced_collectives`` when compiled; ``async_op=True`` runs them at once and returns
a finished work (every rank calls collectives in the same order, so none waits on a later one), and while the worker
loads it is torch's own call. Compiled, whatever the ops do not carry is torch's own behind a graph break, so that
every rank hands the backend its collectives in program order. Tensors staging would not write as the backend does
(unlike dtypes or devices, outputs of the wrong shape or count, outputs that require grad) go to torch's own, which
accepts or rejects them as the backend does. Point-to-point calls run as staged batches, eagerly, where blocks are
kept and this rank is in their group; otherwise they are torch's own. With persistent blocks, object collectives run
on the gloo group over the same ranks, as the worker's own do. Any other name or call (uneven or non-contiguous list
gathers, ``group_src`` and the like) is ``torch.distributed``'s own.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as _dist
from vllm.logger import init_logger

from vllm_omni.platforms import current_omni_platform

from . import module_collectives as kinds
from . import traced_collectives as traced
from .module_collectives import finished_work, module_collectives
from .persistent_collectives import _gathers_into, _writable, _write, cpu_twin
from .request_collectives import platform_collectives, staging

# What a module that names one of these reaches staged, eager and traced alike.
STAGED = frozenset(
    {
        "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
        "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "batch_isend_irecv",
        "isend", "irecv", "send", "recv", "barrier", "broadcast_object_list", "all_gather_object",
    }
)  # fmt: skip

logger = init_logger(__name__)


def __getattr__(name: str):
    return getattr(_dist, name)


def _loading(async_op: bool) -> bool:
    """An ``async_op`` call while the worker loads: nothing to stage, and torch's own keeps its overlap."""
    return async_op and not platform_collectives().staged


_eager = [False]  # inside _eagerly: export keeps is_compiling() true there


def _compiling() -> bool:
    return torch.compiler.is_compiling() and not _eager[0]


@torch.compiler.disable
def _eagerly(call, *args, **kwargs):
    """Compiled, ``call`` behind a graph break: a call the ops do not carry (``async_op=True``, an op they do not name)
    runs staged as eager code does, and every rank still hands the backend its collectives in program order."""
    before, _eager[0] = _eager[0], True
    try:
        return call(*args, **kwargs)
    finally:
        _eager[0] = before


def _torchs_own(call, *args, **kwargs):
    """``call``, one of torch's own collectives; compiled, behind a graph break (Inductor would order it among its
    own collectives, but not against the ops)."""
    return _eagerly(call, *args, **kwargs) if _compiling() else call(*args, **kwargs)


def _done(async_op: bool, group, *outputs: torch.Tensor):
    if not async_op or _dist.distributed_c10d._rank_not_in_group(group):
        return None
    return finished_work(list(outputs))


def _copy_out(outputs, parts) -> None:
    write = torch.Tensor.copy_ if _compiling() else _write
    for out, part in zip(outputs, parts, strict=True):
        write(out, part)


def all_reduce(tensor, op=_dist.ReduceOp.SUM, group=None, async_op=False):
    if not staging():
        return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    if _compiling():
        if async_op or traced.reduce_name(op) is None:
            return _eagerly(all_reduce, tensor, op, group, async_op)
        traced.all_reduce(tensor, traced.reduce_name(op), group)
        return None
    if _loading(async_op):
        return _dist.all_reduce(tensor, op=op, group=group, async_op=True)
    platform_collectives().all_reduce(tensor, group, op)
    return _done(async_op, group, tensor)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    if not staging() or src is None or group_src is not None:  # by rank within the group: torch's own
        return _torchs_own(_dist.broadcast, tensor, src=src, group=group, async_op=async_op, group_src=group_src)
    if _compiling():
        if async_op:
            return _eagerly(broadcast, tensor, src, group, async_op)
        traced.broadcast(tensor, src, group)
        return None
    if _loading(async_op):
        return _dist.broadcast(tensor, src=src, group=group, async_op=True)
    platform_collectives().broadcast(tensor, src, group)
    return _done(async_op, group, tensor)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    if not staging():
        return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor = tensor.contiguous()
    if not _gathers_into(tensor_list, tensor, _dist.get_world_size(group)):
        return _torchs_own(_dist.all_gather, tensor_list, tensor, group=group, async_op=async_op)
    if _compiling():
        if async_op:
            return _eagerly(all_gather, tensor_list, tensor, group, async_op)
        _copy_out(tensor_list, traced.all_gather(tensor, group).view(len(tensor_list), *tensor.shape).unbind(0))
        return None
    if _loading(async_op):
        return _dist.all_gather(tensor_list, tensor, group=group, async_op=True)
    platform_collectives().all_gather_into_tensor(tensor_list, tensor, group)
    return _done(async_op, group, *tensor_list)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    if not staging():
        return _dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
    input_tensor = input_tensor.contiguous()
    if not _gathers_into(output_tensor, input_tensor, _dist.get_world_size(group)):
        return _torchs_own(_dist.all_gather_into_tensor, output_tensor, input_tensor, group=group, async_op=async_op)
    if _compiling():
        if async_op:
            return _eagerly(all_gather_into_tensor, output_tensor, input_tensor, group, async_op)
        output_tensor.copy_(traced.all_gather(input_tensor, group).view(output_tensor.shape))
        return None
    if _loading(async_op):
        return _dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=True)
    platform_collectives().all_gather_into_tensor(output_tensor, input_tensor, group)
    return _done(async_op, group, output_tensor)


def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
    """torch 2.13's name for ``all_gather_into_tensor``; off, torch's own under the name the caller used."""
    if not staging():
        return _dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output, input, op=_dist.ReduceOp.SUM, group=None, async_op=False):
    if not staging():
        return _dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
    if not _writable(output, input):
        return _torchs_own(_dist.reduce_scatter_tensor, output, input, op=op, group=group, async_op=async_op)
    if _compiling():
        if async_op or traced.reduce_name(op) is None:
            return _eagerly(reduce_scatter_tensor, output, input, op, group, async_op)
        output.copy_(kinds.reduce_scatter(input, traced.reduce_name(op), group).view(output.shape))
        return None
    if _loading(async_op):
        return _dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=True)
    module_collectives().reduce_scatter_tensor(output, input, group, op)
    return _done(async_op, group, output)


def reduce_scatter_single(output, input, op=_dist.ReduceOp.SUM, group=None, async_op=False):
    """torch 2.13's name for ``reduce_scatter_tensor``; off, torch's own under the name the caller used."""
    if not staging():
        return _dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
    return reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    if not staging():
        return _dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group, async_op)
    splits = (output_split_sizes, input_split_sizes)
    if not _writable(output, input):
        return _torchs_own(_dist.all_to_all_single, output, input, *splits, group=group, async_op=async_op)
    if _compiling():
        one_sided = (output_split_sizes is None) != (input_split_sizes is None)  # the op sizes its output by both
        if async_op or one_sided:
            return _eagerly(all_to_all_single, output, input, *splits, group, async_op)
        output.copy_(kinds.all_to_all(input, *splits, group).view(output.shape))
        return None
    if _loading(async_op):
        return _dist.all_to_all_single(output, input, *splits, group=group, async_op=True)
    module_collectives().all_to_all_single(output, input, group, *splits)
    return _done(async_op, group, output)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """One staged ``all_to_all_single`` of the tensors flattened, split by their sizes: the same wire collective on
    every rank, whatever each rank's shapes."""
    if not staging():
        return _dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)
    first, parts = input_tensor_list[0], [*output_tensor_list, *input_tensor_list]
    alike = all(t.dtype == first.dtype and t.device == first.device for t in parts)
    alike = alike and not any(t.requires_grad for t in output_tensor_list)  # written as a backend writes
    if not (alike and _one_per_rank(output_tensor_list, group) and _one_per_rank(input_tensor_list, group)):
        return _torchs_own(_dist.all_to_all, output_tensor_list, input_tensor_list, group=group, async_op=async_op)
    if _compiling() and async_op:
        return _eagerly(all_to_all, output_tensor_list, input_tensor_list, group, async_op)
    if _loading(async_op):
        return _dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=True)
    sizes = [[t.numel() for t in tensors] for tensors in (output_tensor_list, input_tensor_list)]
    received = first.new_empty(sum(sizes[0]))
    all_to_all_single(received, torch.cat([t.reshape(-1) for t in input_tensor_list]), *sizes, group=group)
    _copy_out(
        output_tensor_list,
        [part.view(t.shape) for part, t in zip(received.split(sizes[0]), output_tensor_list, strict=True)],
    )
    return _done(async_op, group, *output_tensor_list)


def _one_per_rank(tensors: list, group) -> bool:
    return len(tensors) == _dist.get_world_size(group)


def batch_isend_irecv(p2p_op_list):
    if not staging():
        return _dist.batch_isend_irecv(p2p_op_list)
    return _staged_batch(p2p_op_list)


@torch.compiler.disable  # Dynamo breaks the graph at point-to-point calls anyway; run eagerly, they are staged
def _staged_batch(p2p_op_list):
    return module_collectives().batch_isend_irecv(p2p_op_list)


def _p2p(op, tensor, peer, group, tag, group_peer):
    if not staging() or not platform_collectives().staged:
        return None  # nothing to stage: torch's own call, not a batch (NCCL's first batch needs every rank)
    if peer is None or group_peer is not None or _dist.distributed_c10d._rank_not_in_group(group):
        return None  # by rank within the group, from any source, or outside the group: torch's own
    return batch_isend_irecv([_dist.P2POp(op, tensor, peer, group, tag)])[0]


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    work = _p2p(_dist.isend, tensor, dst, group, tag, group_dst)
    return work if work is not None else _dist.isend(tensor, dst, group=group, tag=tag, group_dst=group_dst)


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    work = _p2p(_dist.irecv, tensor, src, group, tag, group_src)
    return work if work is not None else _dist.irecv(tensor, src, group=group, tag=tag, group_src=group_src)


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    work = _p2p(_dist.isend, tensor, dst, group, tag, group_dst)
    if work is None:
        return _dist.send(tensor, dst, group=group, tag=tag, group_dst=group_dst)
    work.wait()


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    work = _p2p(_dist.irecv, tensor, src, group, tag, group_src)
    if work is None:
        return _dist.recv(tensor, src, group=group, tag=tag, group_src=group_src)
    work.wait()
    return src


_TORCH_P2P = {isend: _dist.isend, irecv: _dist.irecv}


def P2POp(op, tensor, *args, **kwargs) -> _dist.P2POp:  # noqa: N802 - torch's name, which modules call
    """torch's own ``P2POp``, also taking this module's ``isend`` and ``irecv`` as its op: a module names them
    ``dist.isend``. Compiled, Dynamo meets torch's class, as in the release."""
    return _dist.P2POp(_TORCH_P2P.get(op, op), tensor, *args, **kwargs)


def barrier(group=None, async_op=False, device_ids=None, timeout=None):
    plain = not staging() or async_op or torch.compiler.is_compiling() or timeout is not None
    if plain or _dist.distributed_c10d._rank_not_in_group(group):  # outside the group: torch answers it
        return _dist.barrier(group=group, async_op=async_op, device_ids=device_ids, timeout=timeout)
    collectives, device = module_collectives(), current_omni_platform.get_torch_device()
    gloo_on_a_device = device.type != "cpu" and _dist.get_backend(group) == "gloo"  # no device tensors there
    if not collectives.staged or gloo_on_a_device:
        return _dist.barrier(group=group, async_op=async_op, device_ids=device_ids, timeout=timeout)
    collectives.barrier(group, device)


def _object_group(group):
    twin = cpu_twin(group) if staging() and platform_collectives().staged else None
    return group if twin is None else twin


def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
    on = _object_group(group)
    return _dist.broadcast_object_list(object_list, src, on, device if on is group else None, group_src)


def all_gather_object(object_list, obj, group=None):
    return _dist.all_gather_object(object_list, obj, group=_object_group(group))


def scope_remote_code(model: Any) -> list[str]:
    """The loaded modules of ``model``'s package, remote code a checkpoint brings that no change here can edit, get
    this module for ``torch.distributed`` (torch itself is left alone); returns what it rebound."""
    package = type(model).__module__.rpartition(".")[0]
    if model is None or not package or not staging():  # off: the remote code's own torch.distributed
        return []
    this, bound = sys.modules[__name__], []
    for name, loaded in list(sys.modules.items()):
        if loaded is not None and name.startswith(f"{package}."):
            for attribute, value in list(vars(loaded).items()):
                if value is _dist:
                    setattr(loaded, attribute, this)
                    bound.append(f"{name}.{attribute}")
    if bound:
        logger.info("[PERSISTENT_COLLECTIVES] remote code's collectives through managed_distributed: %s", bound)
    return bound
