# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Start real ``torch.distributed`` ranks (gloo on CPU) as processes of their own and collect what each reports.

Self-contained (torch only): the tests that use it need nothing else to start their ranks.
"""

from __future__ import annotations

import importlib
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

# Imported first by the server every rank forks from, and again by each rank in case the server could not: what must
# be in place before anything else of the code under test is imported (empty unless a test suite names some).
PRELOAD: tuple[str, ...] = ()


def _rank_entry(fn, rank, world_size, port, backend, pg_timeout_s, results, env, prepare, preload, args) -> None:
    os.environ.clear()  # a forked rank has the environment its server started with: the caller's, as of this call
    os.environ.update(env)
    import torch.distributed as dist

    try:
        if prepare is not None:
            prepare()
        for name in preload:  # a no-op where the server imported it (the server passes over a module that fails)
            importlib.import_module(name)
        timeout = timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which decides
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    pg_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    prepare: Callable[[], None] | None = None,
    backend: str = "gloo",
) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes of their own joined in one process group.

    The ranks fork from one server, started by the first call, that imported ``PRELOAD`` and that call's module
    (vLLM-Omni's imports take seconds in every process); with ``prepare`` they are spawned instead, each a fresh
    interpreter that runs it first, for what is read only when vLLM-Omni loads. Either way a rank sees the caller's
    environment as of this call, plus ``env``.

    Returns ``{rank: ("ok", result) | ("error", traceback)}`` for the ranks that reported within
    ``timeout_s``; ranks still running then are killed and absent, so a hang shows as a missing rank.
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if prepare is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*PRELOAD, *([fn.__module__] if fn.__module__ != "__main__" else [])])
    else:
        ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # The parent holds the rendezvous store on a port the OS picked and keeps it bound until the ranks are done: no
    # port is chosen, released and then raced for by whatever else starts meanwhile.
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    port = store.port
    environ = os.environ | (env or {})
    procs = [
        ctx.Process(
            target=_rank_entry,
            args=(fn, rank, world_size, port, backend, pg_timeout_s, results, environ, prepare, PRELOAD, args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    reported: dict[int, tuple[str, Any]] = {}
    while len(reported) < world_size and time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=1.0)
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and results.empty():
                break
            continue
        reported[rank] = (status, payload)
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    del store
    return reported


def results_or_raise(reported: dict[int, tuple[str, Any]], world_size: int) -> list[Any]:
    """Every rank's result in rank order; raises with the tracebacks if any rank failed or never reported."""
    problems = [f"rank {r}: no report (hung or crashed)" for r in range(world_size) if r not in reported]
    problems += [f"rank {r} failed:\n{payload}" for r, (status, payload) in sorted(reported.items()) if status != "ok"]
    if problems:
        raise RuntimeError("\n".join(problems))
    return [reported[r][1] for r in range(world_size)]
