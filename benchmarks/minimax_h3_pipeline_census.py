# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""A census of every collective a MiniMax-H3 request makes, by component, with the tile-gather fix off and on.

Serves the whole synthetic pipeline with ``vllm-omni serve`` on four CPU ranks (TP 4 + VAE patch parallel
4 in tile mode, model-level offload; ``--layout ulysses`` or ``ring`` for sequence parallel instead of TP),
once with the fix off and once on, ``--requests`` identical requests each. Every worker keeps a census
(``minimax_h3_gather.census``): per request, component and call site, the calls, bytes moved, and how many
buffers were fresh (new to the backend: a registration on XPU) or persistent across an ``empty_cache``.
Prints a table, writes ``census.json`` and ``census.png``, and projects the bytes to the seed's geometry.

    python -m benchmarks.minimax_h3_pipeline_census --requests 3 --output-dir out/census
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from minimax_h3_bench import report, serve_cpu
from minimax_h3_gather.census import CENSUS_ENV, COMPONENTS

MIB = 1024 * 1024
LAYOUTS = {
    "tp": ("--tensor-parallel-size=4",),
    "ulysses": ("--usp=4",),
    "ring": ("--ring=4",),
}
COMMON_FLAGS = tuple(f for f in serve_cpu.SERVE_FLAGS if not f.startswith("--tensor-parallel-size"))
PROMPT = "a red fox running through fresh snow"
TOTALS = ("calls", "bytes_sent", "bytes_received", "fresh_buffers", "fresh_bytes", "persistent_buffers")

# The seed's request (vllm-omni #6996): 1344x768, 209 frames, 2 steps (one DiT forward), TP 4, real widths:
# DiT hidden 5376 with 50 blocks and 2 refiner blocks; the video VAE decodes a 4x7 grid of 256-px tiles.
SEED = {"height": 768, "width": 1344, "frames": 209, "hidden": 5376, "blocks": 52, "tiles": 28, "tile": 256}


def serve_and_count(model: Path, out: Path, layout: str, fix: str, requests: int) -> dict[str, Any]:
    """One server, ``requests`` identical requests; returns the media digests and every rank's census."""
    run_dir = out / f"{layout}-fix-{fix}"
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("census-rank*.json"):
        stale.unlink()
    flags = (*COMMON_FLAGS, *LAYOUTS[layout])
    reuse = "1" if fix == "on" else "0"
    env = {CENSUS_ENV: str(run_dir)}
    media, request_wall_s = [], []
    with serve_cpu.serve(model, run_dir / "server.log", reuse=reuse, flags=flags, env=env) as server:
        for _ in range(requests):
            start = time.perf_counter()
            media.append(serve_cpu.request_video(server, PROMPT, seed=0))
            request_wall_s.append(time.perf_counter() - start)
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("census-rank*.json"))]
    if len(ranks) != serve_cpu.WORLD or any(len(r["requests"]) != requests for r in ranks):
        got = [len(r["requests"]) for r in ranks]
        raise RuntimeError(f"{run_dir}: expected {requests} requests from {serve_cpu.WORLD} ranks, got {got}")
    digests = [hashlib.sha256(m).hexdigest() for m in media]
    return {"media_sha256": digests, "ranks": ranks, "request_wall_s": request_wall_s}


def by_component(request: dict[str, Any]) -> dict[str, dict[str, int]]:
    """One rank's request, summed per component over its call sites."""
    totals = {c: dict.fromkeys(TOTALS, 0) for c in COMPONENTS}
    for component, sites in request["books"].items():
        for books in sites.values():
            for key in TOTALS:
                totals[component][key] += books[key]
    return totals


def projection(run: dict[str, Any]) -> dict[str, Any]:
    """Bytes per request at the seed's geometry, rescaled from the synthetic run's (a projection, not a measurement).

    DiT: x (S_seed / S_syn) x (5376 / hidden_syn) x (52 / blocks_syn), S being the DiT sequence length: S_syn
    is read off the recorded all-reduce shapes, S_seed = 62,496 video tokens (62 latent frames x 24 x 42 patches)
    plus the synthetic run's audio and text tokens scaled by duration (209 / 96 frames). Video VAE: x (28 x 256^2)
    / (tiles_syn x tile_syn^2) x (209 / frames decoded_syn): every rank receives every tile. Text encoder:
    x 1 (the prompt's tokens, 5120 wide in both).
    """
    from minimax_h3_bench.synthetic.pipeline import DIT, REQUEST, VIDEO_VAE

    request = run["ranks"][0]["requests"][-1]
    dit_rows = [  # the leading dim of every 2-D or larger all-reduce: the sequence length, at its largest
        dims[0]
        for site, books in request["books"].get("dit", {}).items()
        if site.startswith("all_reduce")
        for dims in (re.findall(r"\d+", shape.partition("[")[2]) for shape in books["shapes"])
        if len(dims) >= 2
    ]
    dit_rows = [int(rows) for rows in dit_rows]
    latent_frames = 5 * ((SEED["frames"] - 5 + 16) // 17) + 2  # 17n+5 frames <-> 5n+2 latents
    seed_video = latent_frames * (SEED["height"] // 32) * (SEED["width"] // 32)
    syn_video = 32 * (REQUEST["height"] // 32) * (REQUEST["width"] // 32)
    syn_tokens = max(dit_rows, default=syn_video)
    seed_tokens = seed_video + (syn_tokens - syn_video) * SEED["frames"] / REQUEST["num_frames"]
    syn_blocks = DIT["num_layers"] + DIT["token_refiner_num_layers"]
    tiles = (REQUEST["height"] // (VIDEO_VAE["vae_tile_size"] - VIDEO_VAE["vae_tile_overlap_min"])) ** 2
    syn_frames = 32 * VIDEO_VAE["temporal_ratio"]
    scales = {
        "dit": seed_tokens / syn_tokens * SEED["hidden"] / DIT["hidden_size"] * SEED["blocks"] / syn_blocks,
        "video_vae": SEED["tiles"]
        * SEED["tile"] ** 2
        / (tiles * VIDEO_VAE["vae_tile_size"] ** 2)
        * SEED["frames"]
        / syn_frames,
        "text_encoder": 1.0,
        "audio_vae": 1.0,
        "other": 1.0,
    }
    totals = by_component(request)
    return {
        "formula": " ".join(projection.__doc__.split("\n\n")[1].split()),
        "scales": scales,
        "dit_tokens": {"synthetic": syn_tokens, "seed": round(seed_tokens)},
        "fresh_MiB_per_request_rank0": {c: totals[c]["fresh_bytes"] * scales[c] / MIB for c in COMPONENTS},
        "received_MiB_per_request_rank0": {c: totals[c]["bytes_received"] * scales[c] / MIB for c in COMPONENTS},
    }


def format_table(summary: dict[str, Any]) -> str:
    header = ["fix", "req", "component", "calls", "MiB sent", "MiB recv", "fresh bufs", "fresh MiB", "persistent"]
    lines = [header]
    for fix, run in summary["runs"].items():
        for index, request in enumerate(run["ranks"][0]["requests"], start=1):
            for component, t in by_component(request).items():
                if t["calls"]:
                    mib = [f"{t[key] / MIB:.2f}" for key in ("bytes_sent", "bytes_received", "fresh_bytes")]
                    counts = [str(t[key]) for key in ("calls", "fresh_buffers", "persistent_buffers")]
                    lines.append([fix, str(index), component, counts[0], *mib[:2], counts[1], mib[2], counts[2]])
    text = report.align(lines)
    text.append("")
    for fix, run in summary["runs"].items():
        for index, request in enumerate(run["ranks"][0]["requests"], start=1):
            timeline = " > ".join(request["timeline"])
            text.append(f"fix {fix}, request {index}: {request['releases']} release(s); {timeline}")
    text += [""] + format_timing(summary)
    proj = summary["projection"]
    if proj is None:
        text.append(f"media identical with the fix off and on: {summary['media_identical']}")
        return "\n".join(text)
    text.append("")
    text.append("PROJECTION (not a measurement) to 1344x768, 209 frames, TP 4, real widths; rank 0, per request:")
    text.append(f"  {proj['formula']}")
    for component in COMPONENTS:
        fresh = proj["fresh_MiB_per_request_rank0"][component]
        received = proj["received_MiB_per_request_rank0"][component]
        if received:
            scale = proj["scales"][component]
            text.append(f"  {component:>12}: fresh {fresh:10.1f} MiB, received {received:10.1f} MiB (x{scale:.1f})")
    text.append(f"media identical with the fix off and on: {summary['media_identical']}")
    return "\n".join(text)


def format_timing(summary: dict[str, Any]) -> list[str]:
    """Seconds per request, client wall and each rank's wall and CPU. Not a comparison of the fix: the servers
    ran one after the other; the paired ratios are the VAE benchmark's."""
    where = f"{os.cpu_count()} CPU core(s), {serve_cpu.WORLD} ranks"
    text = [f"seconds per request (not compared: the servers ran in turn; {where})"]
    lines = [["fix", "req", "client wall", *(f"rank {r} wall / CPU" for r in range(serve_cpu.WORLD))]]
    for fix, run in summary["runs"].items():
        for index, client in enumerate(run["request_wall_s"]):
            ranks = [f"{r['timing'][index]['wall_s']:.2f} / {r['timing'][index]['cpu_s']:.2f}" for r in run["ranks"]]
            lines.append([fix, str(index + 1), f"{client:.2f}", *ranks])
    return text + report.align(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    runs = summary["runs"]
    requests = len(runs["off"]["ranks"][0]["requests"])
    for offset, fix in ((-0.2, "off"), (0.2, "on")):
        bottom = [0.0] * requests
        for component, colour in zip(COMPONENTS, ("C0", "C1", "C2", "C3", "C7"), strict=True):
            values = [by_component(r)[component]["fresh_bytes"] / MIB for r in runs[fix]["ranks"][0]["requests"]]
            label = f"{component} (fix {fix})" if any(values) else None
            positions = [i + 1 + offset for i in range(requests)]
            hatch = "" if fix == "off" else "//"
            ax.bar(positions, values, 0.38, bottom=bottom, color=colour, hatch=hatch, label=label)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    title = "Fresh bytes handed to collectives, rank 0"
    ax.set(xlabel="request (left bar: fix off, right bar: fix on)", ylabel="MiB", title=title)
    report.save(fig, [ax], path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3, help="identical requests per server (default 3)")
    parser.add_argument("--layout", choices=tuple(LAYOUTS), default="tp", help="DiT parallelism (default tp)")
    parser.add_argument("--output-dir", type=Path, default=Path("out/census"))
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the synthetic pipeline is written")
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error(f"--requests={args.requests}: expected an integer >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from minimax_h3_bench.synthetic.pipeline import build_synthetic_pipeline

    model = build_synthetic_pipeline(args.cache_dir)
    runs = {}
    for fix in ("off", "on"):
        where = f"{args.requests} requests on {serve_cpu.WORLD} CPU ranks"
        print(f"[census] {args.layout}, fix {fix}: {where}", file=sys.stderr)
        runs[fix] = serve_and_count(model, args.output_dir, args.layout, fix, args.requests)
    summary = {
        "config": {"layout": args.layout, "requests": args.requests, "world_size": serve_cpu.WORLD},
        "versions": {p: version(p) for p in ("torch", "vllm-omni")},
        "runs": runs,
        "media_identical": runs["off"]["media_sha256"] == runs["on"]["media_sha256"],
        "projection": projection(runs["on"]) if args.layout == "tp" else None,  # its formula assumes TP 4
    }
    (args.output_dir / "census.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.output_dir / "census.png")
    print(format_table(summary))
    print(f"[census] wrote {args.output_dir / 'census.json'} and {args.output_dir / 'census.png'}", file=sys.stderr)
    if not summary["media_identical"]:
        print("[census] FAIL: media differ with the fix off and on", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
