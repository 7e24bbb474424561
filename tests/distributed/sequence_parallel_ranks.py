# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for the sequence-parallel tests: vLLM-Omni's Ulysses all-to-all and Ring exchange
(``diffusion/distributed/comm.py``) compiled as a DiT block compiles them (Wan2.2's attention is inside its
compiled blocks), eager as the oracle."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.collective_ranks import SWITCH_ENV, bits, close_floats, data, run_switched


def _comm() -> Any:
    """``comm``, whose ``dist`` is ``managed_distributed``."""
    from vllm_omni.diffusion.distributed import comm
    from vllm_omni.distributed import managed_distributed

    assert comm.dist is managed_distributed, comm.dist
    return comm


class _Ulysses(torch.nn.Module):
    """Ulysses attention's pattern: heads for sequence, a head-local op, and back (two even all-to-alls)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group, self.comm = group, _comm()
        self.linear = torch.nn.Linear(8, 8)
        torch.nn.init.normal_(self.linear.weight, generator=torch.Generator().manual_seed(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.comm.SeqAllToAll4D.apply(self.group, self.linear(x), 2, 1)
        return self.comm.SeqAllToAll4D.apply(self.group, torch.nn.functional.gelu(heads) * 2, 1, 2)


class _Ring(_Ulysses):
    """Ring attention's pattern: pass this rank's block to the next rank, take the previous rank's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ring = self.comm.RingComm(self.group)
        received = ring.send_recv(self.linear(x))
        ring.commit()
        ring.wait()
        return received * 2 + x


def compile_checks(rank: int, world: int, backends: tuple[str, ...] = ("aot_eager",)) -> dict[str, Any]:
    """Both patterns compiled with ``backends`` (dynamic shapes, inference mode), switch off and on."""
    import torch._inductor.config
    from torch._dynamo.utils import counters

    torch._inductor.config.force_disable_caches = True  # a cached graph must not hide a regression
    torch.set_num_threads(1)
    inputs = [data(rank, (1, rows, 4, 8), torch.float32, salt=rows) for rows in (2, 4)]
    report: dict[str, Any] = {}
    for name, module in (("ulysses", _Ulysses(dist.group.WORLD)), ("ring", _Ring(dist.group.WORLD))):
        os.environ[SWITCH_ENV] = "0"
        with torch.inference_mode():
            eager = [bits(module(x)) for x in inputs]
        for backend in backends:
            compiled = torch.compile(module, backend=backend, dynamic=True, fullgraph=name == "ulysses")
            runs: dict[str, Any] = {}
            for switch in ("0", "1"):
                counters.clear()
                runs[switch], runs[f"request{switch}"] = run_switched(switch, compiled, inputs, compiled=True)
                runs[f"breaks{switch}"] = sum(counters["graph_break"].values())
            report[f"{name}/{backend}"] = {
                "equal": runs["0"] == runs["1"],
                "close": close_floats(runs["0"], runs["1"]),
                "equal_to_eager": runs["1"] == eager,  # Inductor may fuse into other roundings: aot_eager's only
                "graph_breaks": (runs["breaks0"], runs["breaks1"]),
                "staged": (runs["request1"]["calls"], runs["request1"]["unmanaged"]),
            }
    dist.barrier()
    return report
