# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Reproduce the MiniMax-H3 VAE gather leak and show it gone: three gather strategies side by side.

Every rank loads the released MiniMaxH3VideoVAE adapter on the synthetic checkpoint three times, one per
strategy (``checkpoint``, ``recv-only``, ``ours``), and serves ``--requests`` identical decodes on each,
in rotating order, each request ending in the adapter's offload as model-level offload does. A
collective ledger (a model of oneCCL's registrations, see ``minimax_h3_gather.ledger``) counts the new
allocations each strategy hands the collectives; with ``--device xpu`` each rank also samples its card's
memory before and after every request. A micro-benchmark then times the gathers alone, interleaved.

    python -m benchmarks.minimax_h3_vae_gather --requests 5 --output-dir out/minimax_h3_vae_gather
    python -m benchmarks.minimax_h3_vae_gather --device xpu --world-size 4   # one rank per card
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from minimax_h3_bench import devices, report
from minimax_h3_bench.ranks import results_or_raise, run_ranks
from minimax_h3_bench.strategies import STRATEGIES

MIB = 1024 * 1024


@dataclass(frozen=True)
class Config:
    component: str
    device: str
    requests: int
    latent_shape: tuple[int, ...]
    micro_reps: int
    ledger_limit: int | None
    strategies: tuple[str, ...]


def _progress(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[bench] {message}", file=sys.stderr, flush=True)


def _synchronize(device) -> None:
    """Wait for the device, so that a timer measures the work and not only its enqueueing."""
    from vllm_omni.diffusion.models.minimax_h3.vae_gather import synchronize

    synchronize(device)


class _TimedGather:
    """Times each call of the gather it wraps, device work included; set on the checkpoint instance in place of it."""

    def __init__(self, inner: Any, device) -> None:
        self.inner = inner
        self.device = device
        self.seconds: list[float] = []

    def __call__(self, tasks, num_tiles):
        _synchronize(self.device)
        start = time.perf_counter()
        try:
            return self.inner(tasks, num_tiles)
        finally:
            _synchronize(self.device)
            self.seconds.append(time.perf_counter() - start)


def _rotated(strategies: tuple[str, ...], turn: int) -> tuple[str, ...]:
    """Strategies in the order of this turn: each goes first in turn, so none always runs warm or cold."""
    shift = turn % len(strategies)
    return strategies[shift:] + strategies[:shift]


def _adapters(world: int, cfg: Config, device) -> dict[str, tuple[Any, Any]]:
    """One released adapter per strategy, with the strategy installed: ``{name: (vae, stats source)}``."""
    from minimax_h3_bench import harness
    from minimax_h3_bench.strategies import install_strategy

    adapters = {}
    for name in cfg.strategies:
        vae = harness.load_video_vae(cfg.component, device)
        vae.set_parallel_size(world)
        adapters[name] = (vae, install_strategy(vae, name))
    return adapters


def _serve_requests(rank: int, world: int, cfg: Config, device) -> dict[str, Any]:
    from minimax_h3_bench import harness
    from minimax_h3_gather.ledger import CollectiveLedger

    adapters, stats_of, timers, ledgers = {}, {}, {}, {}
    for name, (vae, stats) in _adapters(world, cfg, device).items():
        stats_of[name] = stats
        timers[name] = _TimedGather(vae.model._all_gather_tiled_results, device)
        vae.model._all_gather_tiled_results = timers[name]
        adapters[name] = vae
        # On a card the ledger only counts: holding every buffer would itself move the addresses and the memory
        # that the samples measure. On CPU it pins what it sees, the model of oneCCL's registrations.
        ledgers[name] = CollectiveLedger(cfg.ledger_limit, hold_buffers=device.type == "cpu")

    latent = harness.make_latent(cfg.latent_shape, seed=0)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in cfg.strategies}
    decode_seconds: dict[str, list[float]] = {name: [] for name in cfg.strategies}
    with harness.empty_cache_stand_in():
        for request in range(cfg.requests):
            for name in _rotated(cfg.strategies, request):
                _progress(rank, f"request {request + 1}/{cfg.requests} strategy {name}")
                before = devices.sample_memory(device)
                first_gather = len(timers[name].seconds)
                with ledgers[name]:
                    start = time.perf_counter()
                    frames = harness.run_request(adapters[name], latent)
                    _synchronize(device)
                    decode_seconds[name].append(time.perf_counter() - start)
                booked = ledgers[name].end_request()
                after = devices.sample_memory(device)
                stats = stats_of[name].stats() if stats_of[name] is not None else {"workspace_bytes": 0}
                row = booked.as_dict() | {
                    "frames_sha256": harness.digest(frames),
                    "workspace_bytes": stats["workspace_bytes"],
                    "gather_ms_median": 1e3 * statistics.median(timers[name].seconds[first_gather:]),
                    "decode_ms": 1e3 * decode_seconds[name][-1],
                }
                if after is not None:
                    row |= {f"device_{k}": v for k, v in asdict(after).items()}
                    row["device_non_pytorch_bytes"] = after.non_pytorch_bytes
                    row["device_non_pytorch_growth_bytes"] = after.non_pytorch_bytes - before.non_pytorch_bytes
                rows[name].append(row)
    return {
        "requests": rows,
        "gather_ms_median": {n: 1e3 * statistics.median(timers[n].seconds) for n in cfg.strategies},
        "decode_ms_median": {n: 1e3 * statistics.median(decode_seconds[n]) for n in cfg.strategies},
    }


def _time_gathers(rank: int, world: int, cfg: Config, device) -> dict[str, float]:
    """Per-call gather time on the canonical grid scaled down (28 tiles, 7 per rank), interleaved."""
    import torch
    import torch.distributed as dist

    adapters = _adapters(world, cfg, device)
    gathers = {name: vae.model._all_gather_tiled_results for name, (vae, _) in adapters.items()}
    checkpoint = next(iter(adapters.values()))[0].model
    tile_shape = (1, 3, 2 * checkpoint.temporal_ratio, checkpoint.tile_size, checkpoint.tile_size)
    num_tiles = 28
    generator = torch.Generator().manual_seed(rank)
    tasks = [torch.randn(tile_shape, generator=generator).to(device) for _ in range(rank, num_tiles, world)]
    seconds: dict[str, list[float]] = {name: [] for name in cfg.strategies}
    for rep in range(cfg.micro_reps + 2):
        for name in _rotated(cfg.strategies, rep):
            dist.barrier()
            start = time.perf_counter()
            tiles = gathers[name](tasks, num_tiles)
            _synchronize(device)
            if rep >= 2:  # two warm-up rounds
                seconds[name].append(time.perf_counter() - start)
            del tiles
    return {name: 1e3 * statistics.median(s) for name, s in seconds.items()}


def _bench_rank(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    from minimax_h3_bench import harness

    device = devices.rank_device(cfg.device, rank)
    harness.join_vllm_omni_world(rank, world)
    served = _serve_requests(rank, world, cfg, device)
    _progress(rank, f"micro-benchmark: {cfg.micro_reps} interleaved gathers per strategy")
    served["micro_gather_ms_median"] = _time_gathers(rank, world, cfg, device)
    return served


def summarize(per_rank: list[dict[str, Any]], cfg: Config) -> dict[str, Any]:
    """Rank 0's books, with the frames checked identical across strategies and ranks."""
    lead = per_rank[0]
    strategies = {}
    for name in cfg.strategies:
        strategies[name] = {
            "requests": lead["requests"][name],
            "gather_ms_median": lead["gather_ms_median"][name],
            "decode_ms_median": lead["decode_ms_median"][name],
            "micro_gather_ms_median": lead["micro_gather_ms_median"][name],
        }
    digests = {
        row["frames_sha256"] for result in per_rank for name in cfg.strategies for row in result["requests"][name]
    }
    frames_identical = len(digests) == 1
    micro = lead["micro_gather_ms_median"]
    summary = {
        "config": asdict(cfg),
        "versions": {p: version(p) for p in ("torch", "vllm-omni", "diffusers")},
        "world_size": len(per_rank),
        "strategies": strategies,
        "frames_identical": frames_identical,
        "gather_speedup_vs_checkpoint": micro["checkpoint"] / micro["ours"] if "ours" in micro else None,
        "decode_ratio_vs_checkpoint": (
            lead["decode_ms_median"]["checkpoint"] / lead["decode_ms_median"]["ours"]
            if {"checkpoint", "ours"} <= set(cfg.strategies)
            else None
        ),
    }
    return summary


def format_table(summary: dict[str, Any]) -> str:
    device_columns = summary["config"]["device"] != "cpu"
    header = ["request", "strategy", "new reg", "send", "recv", "send+recv", "barriers", "pinned MiB", "workspace MiB"]
    header += ["gather ms", "decode ms", "frames"]
    if device_columns:
        header += ["non-PyTorch MiB", "growth MiB", "allocated MiB"]
    lines = [header]
    for name, data in summary["strategies"].items():
        for i, row in enumerate(data["requests"], start=1):
            sides = {"send": 0, "recv": 0, "send+recv": 0}
            for by_side in row["new_by_site"].values():
                for side, count in by_side.items():
                    sides[side.split(" ")[0]] += count
            line = [str(i), name, str(row["new_registrations"]), *(str(v) for v in sides.values())]
            line.append(str(row["barrier_temps"]))
            line += [f"{row['pinned_bytes'] / MIB:.2f}", f"{row['workspace_bytes'] / MIB:.2f}"]
            line += [f"{row['gather_ms_median']:.2f}", f"{row['decode_ms']:.1f}", row["frames_sha256"][:12]]
            if device_columns:
                line += [f"{row['device_non_pytorch_bytes'] / MIB:.1f}"]
                line += [f"{row['device_non_pytorch_growth_bytes'] / MIB:.1f}"]
                line += [f"{row['device_allocated_bytes'] / MIB:.1f}"]
            lines.append(line)
    text = report.align(lines)
    text.append("")
    for name, data in summary["strategies"].items():
        text.append(
            f"{name:>10}: gather {data['gather_ms_median']:.2f} ms (micro {data['micro_gather_ms_median']:.2f} ms), "
            f"decode {data['decode_ms_median']:.1f} ms median"
        )
    if summary["gather_speedup_vs_checkpoint"] is not None:
        text.append(
            f"gather speedup vs checkpoint (micro, ratio of medians): {summary['gather_speedup_vs_checkpoint']:.2f}x"
        )
    if summary["decode_ratio_vs_checkpoint"] is not None:
        text.append(f"decode time ratio checkpoint/ours: {summary['decode_ratio_vs_checkpoint']:.3f}x")
    text.append(f"frames identical across strategies and ranks: {summary['frames_identical']}")
    return "\n".join(text)


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    on_device = summary["config"]["device"] != "cpu"
    fig, axes = plt.subplots(1, 2 if on_device else 1, figsize=(12 if on_device else 7, 4.5), squeeze=False)
    for name, data in summary["strategies"].items():
        requests = range(1, len(data["requests"]) + 1)
        axes[0][0].plot(requests, [r["pinned_bytes"] / MIB for r in data["requests"]], marker="o", label=name)
        if on_device:
            axes[0][1].plot(
                requests, [r["device_non_pytorch_bytes"] / MIB for r in data["requests"]], marker="o", label=name
            )
    axes[0][0].set(xlabel="request", ylabel="MiB", title="Pinned by modelled registrations (ledger)")
    if on_device:
        axes[0][1].set(xlabel="request", ylabel="MiB", title="Device memory outside PyTorch (rank 0)")
    fig.suptitle(f"MiniMax-H3 VAE tile gather, {summary['world_size']} ranks on {summary['config']['device']}")
    report.save(fig, list(axes[0]), path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5, help="requests per strategy (default 5)")
    parser.add_argument("--output-dir", type=Path, default=Path("out/minimax_h3_vae_gather"))
    parser.add_argument("--device", choices=devices.SUPPORTED, default="cpu")
    parser.add_argument("--world-size", type=int, default=4, help="ranks; on XPU one per card (default 4)")
    parser.add_argument("--latent-frames", type=int, default=24, help="latent frames: 2 per gather (default 24)")
    parser.add_argument("--micro-reps", type=int, default=40, help="timed gathers per strategy (default 40)")
    parser.add_argument("--ledger-limit", type=int, default=1000, help="registration cache entries, 0: no limit")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the synthetic checkpoint is written")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before hung ranks are killed")
    args = parser.parse_args(argv)
    for name in ("requests", "world_size", "latent_frames", "micro_reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected an integer >= 1")
    if args.ledger_limit < 0:
        parser.error(f"--ledger-limit={args.ledger_limit}: expected 0 (no limit) or a positive integer")
    chosen = tuple(s.strip() for s in args.strategies.split(","))
    unknown = [s for s in chosen if s not in STRATEGIES]
    if unknown or not chosen or len(set(chosen)) != len(chosen):
        parser.error(f"--strategies={args.strategies!r}: expected distinct names from {', '.join(STRATEGIES)}")
    args.strategies = chosen
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from minimax_h3_bench.synthetic import build_synthetic_checkpoint

    cfg = Config(
        component=str(build_synthetic_checkpoint(args.cache_dir)),
        device=args.device,
        requests=args.requests,
        latent_shape=(1, 4, args.latent_frames, 24, 42),  # 192x336 pixels: the 4x7 grid of 28 tiles
        micro_reps=args.micro_reps,
        ledger_limit=args.ledger_limit or None,
        strategies=args.strategies,
    )
    backend = devices.backend_for(args.device)
    print(f"[bench] {args.world_size} ranks, {backend}, {args.requests} requests", file=sys.stderr)
    # Each spawned rank needs the backend registered too (oneCCL's bindings register "ccl" on import).
    on_device = {"prepare": functools.partial(devices.backend_for, args.device)} if args.device != "cpu" else {}
    reported = run_ranks(_bench_rank, args.world_size, cfg, timeout_s=args.timeout, backend=backend, **on_device)
    summary = summarize(results_or_raise(reported, args.world_size), cfg)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "results.json").write_text(json.dumps(summary, indent=2))
    plot(summary, args.output_dir / "pinned_memory.png")
    print(format_table(summary))
    print(
        f"[bench] wrote {args.output_dir / 'results.json'} and {args.output_dir / 'pinned_memory.png'}", file=sys.stderr
    )
    if not summary["frames_identical"]:
        print("[bench] FAIL: frames differ between strategies or ranks", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
