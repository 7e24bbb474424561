# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Reproduce the MiniMax-H3 VAE gather leak and show it gone: three gather strategies side by side.

Every rank loads the released MiniMaxH3VideoVAE adapter on the synthetic checkpoint three times, one per
strategy (``checkpoint``, ``recv-only``, ``ours``), and serves ``--requests`` identical decodes on each,
in rotating order, each request ending in the adapter's offload as model-level offload does. A
collective ledger (a model of oneCCL's registrations, see ``xpu_collective_memory.ledger``) counts the new
allocations each strategy hands the collectives; with ``--device xpu`` each rank also samples its card's
memory before and after every request. A micro-benchmark then times the gathers alone, interleaved.

    python -m benchmarks.minimax_h3_vae_gather --requests 5 --output-dir out/minimax_h3_vae_gather
    python -m benchmarks.minimax_h3_vae_gather --device xpu --world-size 4   # one rank per card
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from benchmarks import devices, report, stats
from benchmarks.vae_gather_strategies import STRATEGIES
from tests.distributed.ranks import results_or_raise, run_ranks

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
    threads_per_rank: int  # torch intra-op threads: the cores shared out, so that ranks do not fight over them


def _progress(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[bench] {message}", file=sys.stderr, flush=True)


def _synchronize(device) -> None:
    """Wait for the device, so that a timer measures the work and not only its enqueueing."""
    from vllm_omni.distributed.collective_workspaces import synchronize

    synchronize(device)


class _Clock:
    """Wall and CPU seconds of one timed span: CPU is this rank's whole process, gloo's threads included."""

    def __init__(self, device) -> None:
        self.device = device
        self.wall: list[float] = []
        self.cpu: list[float] = []

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        _synchronize(self.device)
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            _synchronize(self.device)
            self.wall.append(time.perf_counter() - wall)
            self.cpu.append(time.process_time() - cpu)


class _TimedGather:
    """Times each call of the gather it wraps, device work included; set on the checkpoint instance in place of it."""

    def __init__(self, inner: Any, device) -> None:
        self.inner = inner
        self.clock = _Clock(device)

    def __call__(self, tasks, num_tiles):
        with self.clock.span():
            return self.inner(tasks, num_tiles)


def _rotated(strategies: tuple[str, ...], turn: int) -> tuple[str, ...]:
    """Strategies in the order of this turn: each goes first in turn, so none always runs warm or cold."""
    shift = turn % len(strategies)
    return strategies[shift:] + strategies[:shift]


def _adapters(world: int, cfg: Config, device) -> dict[str, tuple[Any, Any]]:
    """One released adapter per strategy, with the strategy installed: ``{name: (vae, stats source)}``."""
    from benchmarks.vae_gather_strategies import install_strategy
    from tooling import harness

    adapters = {}
    for name in cfg.strategies:
        vae = harness.load_video_vae(cfg.component, device)
        vae.set_parallel_size(world)
        adapters[name] = (vae, install_strategy(vae, name))
    return adapters


def _serve_requests(rank: int, world: int, cfg: Config, device) -> dict[str, Any]:
    from tooling import harness
    from xpu_collective_memory.ledger import CollectiveLedger

    adapters, stats_of, timers, ledgers = {}, {}, {}, {}
    for name, (vae, source) in _adapters(world, cfg, device).items():
        stats_of[name] = source
        timers[name] = _TimedGather(vae.model._all_gather_tiled_results, device)
        vae.model._all_gather_tiled_results = timers[name]
        adapters[name] = vae
        # On a card the ledger only counts: holding every buffer would itself move the addresses and the memory
        # that the samples measure. On CPU it pins what it sees, the model of oneCCL's registrations.
        ledgers[name] = CollectiveLedger(cfg.ledger_limit, hold_buffers=device.type == "cpu")

    latent = harness.make_latent(cfg.latent_shape, seed=0)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in cfg.strategies}
    decodes = {name: _Clock(device) for name in cfg.strategies}
    gathers_per_request: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in cfg.strategies}
    with harness.empty_cache_stand_in():
        for request in range(cfg.requests):
            for name in _rotated(cfg.strategies, request):
                _progress(rank, f"request {request + 1}/{cfg.requests} strategy {name}")
                before = devices.sample_memory(device)
                clock = timers[name].clock
                first_gather = len(clock.wall)
                with ledgers[name], decodes[name].span():
                    frames = harness.run_request(adapters[name], latent)
                booked = ledgers[name].end_request()
                for kind in ("wall", "cpu"):
                    gathers_per_request[name][kind].append(sum(getattr(clock, kind)[first_gather:]))
                after = devices.sample_memory(device)
                workspace = stats_of[name].stats() if stats_of[name] is not None else {"workspace_bytes": 0}
                row = booked.as_dict() | {
                    "frames_sha256": harness.digest(frames),
                    "workspace_bytes": workspace["workspace_bytes"],
                    "gather_ms_median": 1e3 * statistics.median(clock.wall[first_gather:]),
                    "decode_ms": 1e3 * decodes[name].wall[-1],
                    "decode_cpu_ms": 1e3 * decodes[name].cpu[-1],
                }
                if after is not None:
                    row |= {f"device_{k}": v for k, v in asdict(after).items()}
                    row["device_non_pytorch_bytes"] = after.non_pytorch_bytes
                    row["device_non_pytorch_growth_bytes"] = after.non_pytorch_bytes - before.non_pytorch_bytes
                rows[name].append(row)
    return {
        "requests": rows,
        "seconds": {
            name: {
                "gather_wall": timers[name].clock.wall,
                "gather_cpu": timers[name].clock.cpu,
                "decode_wall": decodes[name].wall,
                "decode_cpu": decodes[name].cpu,
                "request_gathers_wall": gathers_per_request[name]["wall"],
                "request_gathers_cpu": gathers_per_request[name]["cpu"],
            }
            for name in cfg.strategies
        },
    }


def _time_gathers(rank: int, world: int, cfg: Config, device) -> dict[str, dict[str, list[float]]]:
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
    clocks = {name: _Clock(device) for name in cfg.strategies}
    for rep in range(cfg.micro_reps + 2):
        for name in _rotated(cfg.strategies, rep):
            dist.barrier()
            with clocks[name].span():
                tiles = gathers[name](tasks, num_tiles)
            del tiles
    # Two warm-up rounds dropped.
    return {name: {"micro_wall": c.wall[2:], "micro_cpu": c.cpu[2:]} for name, c in clocks.items()}


def _bench_rank(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    import torch

    from tooling import harness

    torch.set_num_threads(cfg.threads_per_rank)
    device = devices.rank_device(cfg.device, rank)
    harness.join_vllm_omni_world(rank, world)
    served = _serve_requests(rank, world, cfg, device)
    _progress(rank, f"micro-benchmark: {cfg.micro_reps} interleaved gathers per strategy")
    for name, seconds in _time_gathers(rank, world, cfg, device).items():
        served["seconds"][name] |= seconds
    return served


_SERIES = ("gather_wall", "gather_cpu", "decode_wall", "decode_cpu", "micro_wall", "micro_cpu")


def _medians_ms(seconds: dict[str, list[float]]) -> dict[str, float]:
    return {f"{k}_ms": 1e3 * statistics.median(seconds[k]) for k in _SERIES}


def _ms(values: list[float]) -> list[float]:
    return [1e3 * v for v in values]


def compare(ours: dict[str, list[float]], other: dict[str, list[float]]) -> dict[str, Any]:
    """Ours against another strategy on one rank: time ratios (ours / other) paired by request for decodes and
    by repetition for the micro-benchmark, and the per-request differences (ours - other) of the decode and of
    its gathers, so that one can be read against the other."""
    decode = stats.paired_difference(_ms(ours["decode_wall"]), _ms(other["decode_wall"]))
    gathers = stats.paired_difference(_ms(ours["request_gathers_wall"]), _ms(other["request_gathers_wall"]))
    return {
        "decode_wall_ratio": stats.paired_ratio(ours["decode_wall"], other["decode_wall"]).as_dict(),
        "decode_cpu_ratio": stats.paired_ratio(ours["decode_cpu"], other["decode_cpu"]).as_dict(),
        "micro_wall_ratio": stats.paired_ratio(ours["micro_wall"], other["micro_wall"]).as_dict(),
        "micro_cpu_ratio": stats.paired_ratio(ours["micro_cpu"], other["micro_cpu"]).as_dict(),
        "decode_wall_difference_ms": decode.as_dict(),
        "request_gathers_wall_difference_ms": gathers.as_dict(),
        # The gathers account for the decode's difference when theirs lies within the decode's interval.
        "gathers_explain_decode": decode.low <= gathers.value <= decode.high,
    }


def summarize(per_rank: list[dict[str, Any]], cfg: Config) -> dict[str, Any]:
    """Rank 0's books, every rank's timings, paired comparisons, and the frames checked identical."""
    lead = per_rank[0]
    strategies = {}
    for name in cfg.strategies:
        medians = _medians_ms(lead["seconds"][name])
        strategies[name] = {
            "requests": lead["requests"][name],
            "gather_ms_median": medians["gather_wall_ms"],
            "decode_ms_median": medians["decode_wall_ms"],
            "micro_gather_ms_median": medians["micro_wall_ms"],
        }
    digests = {
        row["frames_sha256"] for result in per_rank for name in cfg.strategies for row in result["requests"][name]
    }
    cores = os.cpu_count() or 1
    return {
        "config": asdict(cfg),
        "versions": {p: version(p) for p in ("torch", "vllm-omni", "diffusers")},
        "machine": {
            "cpu_count": cores,
            "ranks": len(per_rank),
            "oversubscribed": cores < len(per_rank),
            "torch_threads_per_rank": cfg.threads_per_rank,
            "processor": platform.processor() or platform.machine(),
        },
        "world_size": len(per_rank),
        "strategies": strategies,
        "frames_identical": len(digests) == 1,
        "timing_per_rank": [
            {name: _medians_ms(result["seconds"][name]) for name in cfg.strategies} for result in per_rank
        ],
        "comparisons": {
            f"ours/{other}": [compare(result["seconds"]["ours"], result["seconds"][other]) for result in per_rank]
            for other in cfg.strategies
            if other != "ours" and "ours" in cfg.strategies
        },
    }


def format_timing(summary: dict[str, Any]) -> list[str]:
    machine = summary["machine"]
    text = [
        f"machine: {machine['cpu_count']} CPU core(s) for {machine['ranks']} ranks"
        + (" (oversubscribed: wall time is mostly the scheduler's)" if machine["oversubscribed"] else "")
        + f"; torch intra-op threads per rank: {machine['torch_threads_per_rank']}",
        "",
    ]
    header = ["rank", "strategy", "gather wall", "gather CPU", "decode wall", "decode CPU", "micro wall", "micro CPU"]
    lines = [header]
    for rank, by_strategy in enumerate(summary["timing_per_rank"]):
        for name, medians in by_strategy.items():
            lines.append([str(rank), name, *(f"{medians[f'{k}_ms']:.2f}" for k in _SERIES)])
    text += ["median ms per span; CPU is each rank's process CPU time"] + report.align(lines) + [""]
    for pair, ranks in summary["comparisons"].items():
        text.append(f"{pair} time ratio, paired and interleaved (decodes by request, micro gathers by repetition):")
        for rank, c in enumerate(ranks):
            text.append(
                f"  rank {rank}: decode wall {stats.describe(_estimate(c['decode_wall_ratio']))}, "
                f"CPU {stats.describe(_estimate(c['decode_cpu_ratio']))}"
            )
            text.append(
                f"          micro gather wall {stats.describe(_estimate(c['micro_wall_ratio']))}, "
                f"CPU {stats.describe(_estimate(c['micro_cpu_ratio']))}"
            )
            text.append(
                f"          per request, ours - other: decode "
                f"{stats.describe(_estimate(c['decode_wall_difference_ms']), ' ms', 1)}, of which its gathers "
                f"{stats.describe(_estimate(c['request_gathers_wall_difference_ms']), ' ms', 1)}; the gathers' "
                f"difference {'lies' if c['gathers_explain_decode'] else 'does NOT lie'} within the decode's interval"
            )
    return text


def _estimate(fields: dict[str, float]) -> stats.Estimate:
    return stats.Estimate(**fields)


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
    text += format_timing(summary)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.minimax_h3_vae_gather",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Needs: with --device xpu, --world-size idle cards, one rank each (ZE_AFFINITY_MASK picks which); with "
        "--device cpu, this checkout's CPU set-up. Exit status: 0 when every strategy gave the same frames on every "
        "rank, 1 when not, 2 on a bad argument.",
    )
    parser.add_argument("--requests", type=int, default=10, help="requests per strategy, the decode pairs")
    parser.add_argument(
        "--output-dir", type=Path, default=Path("out/minimax_h3_vae_gather"), help="results.json and the plot"
    )
    parser.add_argument("--device", choices=devices.SUPPORTED, default="cpu", help="where the ranks run")
    parser.add_argument("--world-size", type=int, default=4, help="ranks; on XPU one per card")
    parser.add_argument("--latent-frames", type=int, default=24, help="latent frames: 2 per gather")
    parser.add_argument("--micro-reps", type=int, default=40, help="timed gathers per strategy")
    parser.add_argument("--ledger-limit", type=int, default=1000, help="registration cache entries, 0: no limit")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="where the synthetic checkpoint is written; a user cache if not"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before hung ranks are killed")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("world_size", "latent_frames"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected an integer >= 1")
    for name in ("requests", "micro_reps"):  # paired intervals need two pairs at least
        if getattr(args, name) < 2:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected an integer >= 2")
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
    from tooling.synthetic import build_synthetic_checkpoint

    cfg = Config(
        component=str(build_synthetic_checkpoint(args.cache_dir)),
        device=args.device,
        requests=args.requests,
        latent_shape=(1, 4, args.latent_frames, 24, 42),  # 192x336 pixels: the 4x7 grid of 28 tiles
        micro_reps=args.micro_reps,
        ledger_limit=args.ledger_limit or None,
        strategies=args.strategies,
        threads_per_rank=max(1, (os.cpu_count() or 1) // args.world_size),
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
