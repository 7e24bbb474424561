# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Test plumbing: run the working tree's modules, and start real gloo ranks."""

from __future__ import annotations

import os
import queue
import socket
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO_ROOT / "vllm_omni" / "diffusion" / "models" / "minimax_h3"


def use_working_tree() -> None:
    """Make ``vllm_omni.diffusion.models.minimax_h3.vae_gather`` resolve to this checkout, not an installed copy.

    With a released vLLM-Omni installed, its ``minimax_h3`` is a regular package and our folder (no
    ``__init__.py``, by design) is ignored; putting the folder first on the package's ``__path__`` fixes that.
    """
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import vllm_omni.diffusion.models.minimax_h3 as package

    if str(MODEL_DIR) not in package.__path__:
        package.__path__.insert(0, str(MODEL_DIR))
    stale = sys.modules.get(f"{package.__name__}.vae_gather")
    if stale is not None and Path(stale.__file__).resolve().parent != MODEL_DIR:
        raise RuntimeError(f"vae_gather was imported from {stale.__file__} before the working tree was put first")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(fn, rank, world_size, port, pg_timeout_s, results, env, args) -> None:
    os.environ.update(env)
    try:
        use_working_tree()
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    pg_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined in one gloo group.

    Returns ``{rank: (status, result_or_traceback)}`` for each rank that reported before ``timeout_s``;
    ranks still running then are killed and missing from the result.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_entry,
            args=(fn, rank, world_size, port, pg_timeout_s, results, dict(env or {}), args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    import time

    deadline = time.monotonic() + timeout_s
    reported: dict[int, tuple[str, Any]] = {}
    while len(reported) < world_size and time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
            continue
        reported[rank] = (status, payload)
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return reported


def results_or_raise(reported: dict[int, tuple[str, Any]], world_size: int) -> list[Any]:
    """Every rank's result in rank order; fails with the ranks' tracebacks if any rank failed or hung."""
    problems = [f"rank {r}: no report (hung or crashed)" for r in range(world_size) if r not in reported]
    problems += [f"rank {r} failed:\n{payload}" for r, (status, payload) in sorted(reported.items()) if status != "ok"]
    if problems:
        raise AssertionError("\n".join(problems))
    return [reported[r][1] for r in range(world_size)]
