# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The operator's A/B: a census of every collective a served request makes, by component, per arm.

Serves a whole pipeline (synthetic on CPU ranks, ``--model`` on cards) with ``vllm-omni serve`` on four ranks (VAE patch
parallel 4 in tile mode, model-level offload or ``--offload layerwise``, and the DiT's ``--layout``: TP 4 by default)
once per arm (``PIPELINE_RUNS``), ``--requests`` identical requests each: the whole request staged, in pool mode, the
release without this project's plugin (the plugin at ``0`` leaves every class as released: the same run), and for
MiniMax-H3 its VAE tile gather alone. ``--pipeline`` picks the model: ``minimax_h3`` (default; ``--layout hsdp`` is
FSDP2 over Ulysses 4), ``wan2_2`` (Wan2.2 text-to-video, two experts; ``cfg`` is CFG parallel 2 x Ulysses 2,
``spatial_shard`` the VAE's spatially sharded decode, ``pp`` pipeline parallel 2 x Ulysses 2) or ``qwen_image``
(Qwen-Image text-to-image, joint attention); with ``--model`` it is read from the checkpoint. The servers without and
with the layer run side by side and take their requests in alternating order, so that their request times pair up: the
layer's cost. Every worker keeps a census (``xpu_collective_memory.census``): per request, component and call site, the
calls, bytes moved, and how many buffers were fresh (new to the backend: a registration on XPU) or persistent across an
``empty_cache``, and memory after each request. Prints a table, writes ``census.json`` and ``census.png``, and for
MiniMax-H3 under TP projects the bytes to the seed's geometry.

    python -m benchmarks.pipeline_census --requests 8 --output-dir out/census
    python -m benchmarks.pipeline_census --pipeline wan2_2 --layout ulysses --requests 3
    python -m benchmarks.pipeline_census --pipeline qwen_image --layout ulysses --requests 3
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shlex
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from benchmarks import report, stats
from tooling import serve_cpu
from tooling.upstream_patches import plugins_without_ours
from vllm_omni.diffusion.models.minimax_h3.vae_gather import REUSE_ENV
from vllm_omni.distributed.persistent_collectives import SWITCH_ENV
from vllm_omni.distributed.request_pool import POOL_ENV
from xpu_collective_memory.census import CENSUS_ENV, COMPONENTS
from xpu_collective_memory.overlay import PROJECT_DIST
from xpu_collective_memory.renamed import CENSUS_ENV_BEFORE_0_12, CENSUS_PLUGIN, PLUGIN, listed_plugins

MIB = 1024 * 1024
SEQUENCE_LAYOUTS = {"tp": ("--tensor-parallel-size=4",), "ulysses": ("--usp=4",), "ring": ("--ring=4",)}
# Each pipeline's DiT layouts on four ranks, as vLLM-Omni offers them for it.
CFG_LAYOUT = ("--cfg-parallel-size=2", "--usp=2")
LAYOUTS = {
    "minimax_h3": {**SEQUENCE_LAYOUTS, "hsdp": ("--use-hsdp", "--usp=4")},  # FSDP2 shards each block over 4
    "wan2_2": {
        **SEQUENCE_LAYOUTS,
        "cfg": CFG_LAYOUT,
        "spatial_shard": ("--usp=4", "--vae-parallel-mode=spatial_shard_height"),  # halo exchange in the VAE
        "pp": ("--pipeline-parallel-size=2", "--usp=2"),  # tensor dicts between the two stages
    },
    "qwen_image": {**SEQUENCE_LAYOUTS, "cfg": CFG_LAYOUT},  # joint attention: text beside the image
}
# The checkpoints' model_index.json class names vLLM-Omni serves with each pipeline (Wan2.2: text-to-video).
CLASS_NAMES = {"MiniMaxH3Pipeline": "minimax_h3", "WanPipeline": "wan2_2", "QwenImagePipeline": "qwen_image"}
COMMON_FLAGS = tuple(f for f in serve_cpu.SERVE_FLAGS if not f.startswith(("--tensor-parallel-size", "--enable-cpu")))
# How weights move between the host and the card: model-level (each component in turn, empty_cache() at each switch)
# or layer-wise (each DiT layer in turn, on its own copy stream: what holds memory longer inside a pool).
OFFLOAD_FLAGS = {"model": ("--enable-cpu-offload",), "layerwise": ("--enable-layerwise-offload",)}
PROMPT = "a red fox running through fresh snow"
# Each run's switches: MiniMax-H3's VAE tile gather only, the whole request staged, the whole request in the worker's
# private memory pool (on CPU ranks, the test platform's stand-in for the pool API), and the release.
RUNS = {
    "vae": {REUSE_ENV: "1", SWITCH_ENV: "0", POOL_ENV: "0"},
    "whole": {REUSE_ENV: "1", SWITCH_ENV: "1", POOL_ENV: "0"},
    "pool": {REUSE_ENV: "1", SWITCH_ENV: "0", POOL_ENV: "1"},
    "release": {REUSE_ENV: "0", SWITCH_ENV: "0", POOL_ENV: "0"},  # this project's fix not loaded (the census is)
}
# Per pipeline, its runs, served two at a time side by side with requests interleaved: the first two pair up, the
# staged layer on / off (the VAE's gather alone, else the release).
PIPELINE_RUNS = {
    "minimax_h3": ("whole", "vae", "pool", "release"),
    "wan2_2": ("whole", "release", "pool"),
    "qwen_image": ("whole", "release", "pool"),
}

# Effective device copy bandwidth for the layer's copy cost at the seed's geometry (an assumption, not measured).
COPY_GBS = 500.0
TOTALS = ("calls", "bytes_sent", "bytes_received", "fresh_buffers", "fresh_bytes", "persistent_buffers")

# The seed's request (vllm-omni #6996): 1344x768, 209 frames, 2 steps (one DiT forward), TP 4, real widths:
# DiT hidden 5376 with 50 blocks and 2 refiner blocks; the video VAE decodes a 4x7 grid of 256-px tiles.
SEED = {
    "height": 768,
    "width": 1344,
    "frames": 209,
    "steps": 2,
    "hidden": 5376,
    "blocks": 52,
    "tiles": 28,
    "tile": 256,
}
# A Wan2.2 A14B text-to-video request at its 480p size (vLLM-Omni #6999 reports the growth for Wan2.2 on XPU).
WAN_SEED = {"height": 480, "width": 832, "frames": 81, "steps": 2}
QWEN_SEED = {"height": 1328, "width": 1328, "frames": 1, "steps": 2}  # Qwen-Image's 1:1 size; an image


def _run_dir(out: Path, layout: str, run: str) -> Path:
    run_dir = out / f"{layout}-{run}"
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("census-rank*.json"):
        stale.unlink()
    return run_dir


def serve_and_count(
    model: Path,
    out: Path,
    layout: str,
    runs: tuple[str, ...],
    requests: int,
    *,
    pipeline: str = "minimax_h3",
    device: str = "cpu",
    request: dict[str, Any] | None = None,
    real: bool = False,
    eager: bool = False,
    offload: str = "model",
    serve_args: tuple[str, ...] = (),
    debug_logging: bool = True,
) -> dict[str, Any]:
    """One server per run, all up at once, ``requests`` identical requests each in rotating order.

    ``real``: a real checkpoint (long start-up, long requests). Returns per run the media and their digests, every
    request's client wall time, and every rank's census.
    """
    flags = serve_args or (*COMMON_FLAGS, *OFFLOAD_FLAGS[offload], *LAYOUTS[pipeline][layout])
    flags += ("--enforce-eager",) if eager else ()
    dirs = {run: _run_dir(out, layout, run) for run in runs}
    media: dict[str, list[bytes]] = {run: [] for run in runs}
    walls: dict[str, list[float]] = {run: [] for run in runs}
    with contextlib.ExitStack() as stack:
        servers = {}
        for run in runs:
            # Under the name before 0.12.0 too: an operator's exported old name must not disagree with this run's.
            env = {CENSUS_ENV: str(dirs[run]), CENSUS_ENV_BEFORE_0_12: str(dirs[run]), **RUNS[run]}
            if run == "release":
                env["VLLM_PLUGINS"] = plugins_without_ours()
            log, reuse = dirs[run] / "server.log", RUNS[run][REUSE_ENV]
            startup_s = 3600 if real else 600
            server = serve_cpu.serve(
                model, log, reuse=reuse, flags=flags, env=env, startup_s=startup_s, device=device,
                receipt_logging=debug_logging,
            )  # fmt: skip
            servers[run] = stack.enter_context(server)
        for index in range(requests):
            for run in runs if index % 2 == 0 else runs[::-1]:
                start = time.perf_counter()
                timeout_s = 3600 if real else 600
                send = serve_cpu.request_image if pipeline == "qwen_image" else serve_cpu.request_video
                media[run].append(send(servers[run], PROMPT, 0, request, timeout_s))
                walls[run].append(time.perf_counter() - start)
    results = {}
    for run in runs:
        ranks = [json.loads(p.read_text()) for p in sorted(dirs[run].glob("census-rank*.json"))]
        if len(ranks) != serve_cpu.WORLD or any(len(r["requests"]) != requests for r in ranks):
            got = [len(r["requests"]) for r in ranks]
            raise RuntimeError(f"{dirs[run]}: expected {requests} requests from {serve_cpu.WORLD} ranks, got {got}")
        digests = [hashlib.sha256(m).hexdigest() for m in media[run]]
        results[run] = {"media_sha256": digests, "ranks": ranks, "request_wall_s": walls[run], "media": media[run]}
    return results


def by_component(request: dict[str, Any]) -> dict[str, dict[str, int]]:
    """One rank's request, summed per component over its call sites."""
    totals = {c: dict.fromkeys(TOTALS, 0) for c in COMPONENTS}
    for component, sites in request["books"].items():
        for books in sites.values():
            for key in TOTALS:
                totals[component][key] += books[key]
    return totals


def requests_of(summary: dict[str, Any], fix: str) -> list[tuple[int, int, dict[str, Any]]]:
    """``(rank, request index, request)`` for every rank's requests in the run ``fix`` of a ``census.json``."""
    return [(r["rank"], i, q) for r in summary["runs"][fix]["ranks"] for i, q in enumerate(r["requests"])]


def projection(run: dict[str, Any], whole: dict[str, Any] | None) -> dict[str, Any]:
    """Bytes per request at the seed's geometry, rescaled from the synthetic run's (a projection, not a measurement).

    DiT: x (S_seed / S_syn) x (5376 / hidden_syn) x (52 / blocks_syn), S being the DiT sequence length: S_syn
    is read off the recorded all-reduce shapes, S_seed = 62,496 video tokens (62 latent frames x 24 x 42 patches)
    plus the synthetic run's audio and text tokens scaled by duration (209 / 96 frames). Video VAE: x (28 x 256^2)
    / (tiles_syn x tile_syn^2) x (209 / frames decoded_syn): every rank receives every tile. Text encoder:
    x 1 (the prompt's tokens, 5120 wide in both). Layer: resident = S_seed x 5376 x 2 B (the DiT's bf16
    hidden-state all-reduce, its largest call, a float sum over 4 ranks that the cap cannot chunk, which one
    workspace of the TP group holds) + the synthetic run's workspaces; copies = 2 x the bytes received by every
    component but the video VAE (one copy in, one out).
    """
    from tooling.synthetic.pipeline import DIT, REQUEST, VIDEO_VAE

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
    projected = {
        "formula": " ".join(projection.__doc__.split("\n\n")[1].split()),
        "scales": scales,
        "dit_tokens": {"synthetic": syn_tokens, "seed": round(seed_tokens)},
        "fresh_MiB_per_request_rank0": {c: totals[c]["fresh_bytes"] * scales[c] / MIB for c in COMPONENTS},
        "received_MiB_per_request_rank0": {c: totals[c]["bytes_received"] * scales[c] / MIB for c in COMPONENTS},
        "layer": None,
    }
    if whole is not None:
        layer = layer_per_request(whole["ranks"][0])[-1]
        staged = [c for c in COMPONENTS if c != "video_vae"]  # the VAE's gather keeps its own workspace
        copied = sum(2 * totals[c]["bytes_received"] * scales[c] for c in staged)
        largest = seed_tokens * SEED["hidden"] * 2  # the DiT's bf16 hidden-state all-reduce
        projected["layer"] = {
            "resident_MiB_rank0": (largest + layer["resident_bytes"]) / MIB,
            "copied_MiB_per_request_rank0": copied / MIB,
            "copy_ms_per_request_rank0": copied / (COPY_GBS * 1e9) * 1e3,
            "copy_GBps_assumed": COPY_GBS,
        }
    return projected


def compile_summary(runs: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per run and rank, after its last request: whether the DiT ran compiled, and Dynamo's graph breaks."""
    return {run: [{"rank": r["rank"], **r["compile"][-1]} for r in data["ranks"]] for run, data in runs.items()}


def unmanaged_sites(runs: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per run, every site where a request handed a device group's backend anything but persistent blocks: calls,
    over every rank and request. Empty for the whole-request fix; a new direct call shows up here."""
    found: dict[str, dict[str, int]] = {}
    for name, run in runs.items():
        sites: dict[str, int] = {}
        for rank in run["ranks"]:
            for request in rank["requests"]:
                for site, calls in request["unmanaged_sites"].items():
                    sites[site] = sites.get(site, 0) + calls
        found[name] = dict(sorted(sites.items()))
    return found


def format_compile(summary: dict[str, Any]) -> list[str]:
    lines = []
    for run, ranks in summary["compile"].items():
        compiled = "compiled" if all(r["dit_compiled"] for r in ranks) else "NOT compiled on every rank"
        lines.append(f"{run:>5}: DiT {compiled}; graph breaks per rank {[r['graph_breaks'] for r in ranks]}")
    return lines


def layer_per_request(rank: dict[str, Any]) -> list[dict[str, int]]:
    """The layer's figures per request on one rank: resident workspaces as they stand, the rest per request."""
    rows, previous = [], None
    for snapshot in rank["persistent_collectives"]:
        if snapshot is None:
            return []
        row = dict(snapshot)
        for key in ("staged_calls", "fallbacks", "block_allocations", "payload_bytes", "staged_bytes"):
            row[key] = snapshot.get(key, 0) - (previous.get(key, 0) if previous else 0)
        rows.append(row)
        previous = snapshot
    return rows


def verdicts(summary: dict[str, Any]) -> list[str]:
    """Per arm against the release: memory growth outside PyTorch from request 2 on (the largest of any rank's), the
    allocator's peak reserved memory and its retries after a failed allocation (an out-of-memory error coming
    closer). On CPU ranks the figure is the process RSS: no verdict on device memory."""
    growth = summary["memory_growth"]
    if "release" not in growth or summary["config"]["requests"] < 3:
        return ["verdicts: none (they need the release arm and --requests 3 or more)"]

    def from_request_2(rows: list[dict[str, Any]]) -> float:
        return max(sum(row["growth_MiB"][1:]) for row in rows)

    released = from_request_2(growth["release"])
    lines = [f"verdict per arm against the release (growth outside PyTorch from request 2 on: {released:.1f} MiB)"]
    for arm, rows in growth.items():
        if arm == "release":
            continue
        if rows[0]["metric"] != "non_pytorch_bytes":
            lines.append(f"  {arm}: no verdict: CPU ranks report the process RSS, not device memory")
            continue
        grown = from_request_2(rows)
        peak = max(max(row["peak_reserved_MiB"]) for row in rows)
        retries = max(max(row["alloc_retries"]) for row in rows)
        if grown <= max(1.0, 0.05 * released) and retries == 0:
            verdict = "stops the growth"
        elif grown < released:
            verdict = "reduces the growth" + (", with allocator retries" if retries else "")
        else:
            verdict = "does not stop the growth"
        lines.append(
            f"  {arm}: {verdict}: {grown:.1f} MiB from request 2 on, peak reserved {peak:.0f} MiB, retries {retries}"
        )
    return lines


def memory_growth(runs: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The seed's table: per run and rank, the memory sampled after each request and its growth between them.

    On a device the metric is used minus reserved (outside PyTorch, where oneCCL's registrations show); on
    CPU ranks it is the process RSS, which only shows what the census's own pinning costs.
    """
    table = {}
    for name, run in runs.items():
        rows = []
        for rank in run["ranks"]:
            samples = rank["memory"]
            metric = "rss_bytes" if samples[0]["device"] == "cpu" else "non_pytorch_bytes"
            values = [sample[metric] / MIB for sample in samples]
            growth = [after - before for before, after in zip(values, values[1:], strict=False)]
            row = {"rank": rank["rank"], "metric": metric, "after_request_MiB": values, "growth_MiB": growth}
            if metric == "non_pytorch_bytes":  # the pool arm's cost: what the caching allocator keeps, and whether
                row["reserved_after_request_MiB"] = [sample["reserved_bytes"] / MIB for sample in samples]
                row["peak_reserved_MiB"] = [sample.get("peak_reserved_bytes", 0) / MIB for sample in samples]
                row["alloc_retries"] = [sample.get("alloc_retries", 0) for sample in samples]  # OOM closer?
                row["pool_segments"] = [sample.get("pool_segments", 0) for sample in samples]
                row["pool_MiB"] = [sample.get("pool_bytes", 0) / MIB for sample in samples]
            rows.append(row)
        table[name] = rows
    return table


def format_memory(summary: dict[str, Any]) -> list[str]:
    table = summary["memory_growth"]
    first = next(iter(table.values()))[0]
    steps = [f"growth {i}->{i + 1} MiB" for i in range(1, len(first["after_request_MiB"]))]
    reserved = "reserved_after_request_MiB" in first
    allocator = ["reserved MiB after each", "peak reserved MiB", "retries", "pool segments", "pool MiB"]
    lines = [["run", "rank", "after request 1 MiB", *steps, *(allocator if reserved else [])]]
    for name, rows in table.items():
        for row in rows:
            growth = [f"{g:+.1f}" for g in row["growth_MiB"]]
            kept = []
            if reserved:
                keys = ("reserved_after_request_MiB", "peak_reserved_MiB", "alloc_retries", "pool_segments", "pool_MiB")
                kept = [" / ".join(f"{r:.0f}" for r in row[key]) for key in keys]
            lines.append([name, str(row["rank"]), f"{row['after_request_MiB'][0]:.1f}", *growth, *kept])
    if first["metric"] == "rss_bytes":
        title = f"memory per rank ({memory_label(summary)}):"
    else:
        title = "device memory outside PyTorch per rank (driver used minus memory_reserved(), the seed's measure):"
    return [title, *report.align(lines)]


def memory_label(summary: dict[str, Any]) -> str:
    run = next(iter(summary["runs"].values()))
    return run["ranks"][0]["memory"][0]["label"]


def format_table(summary: dict[str, Any]) -> str:
    header = ["run", "req", "component", "calls", "MiB sent", "MiB recv", "fresh bufs", "fresh MiB", "persistent"]
    header.append("MiB copied")
    lines = [header]
    for fix, run in summary["runs"].items():
        for index, request in enumerate(run["ranks"][0]["requests"], start=1):
            for component, t in by_component(request).items():
                if t["calls"]:
                    mib = [f"{t[key] / MIB:.2f}" for key in ("bytes_sent", "bytes_received", "fresh_bytes")]
                    counts = [str(t[key]) for key in ("calls", "fresh_buffers", "persistent_buffers")]
                    copied = f"{request.get('staged_bytes', {}).get(component, 0) / MIB:.2f}"
                    lines.append(
                        [fix, str(index), component, counts[0], *mib[:2], counts[1], mib[2], counts[2], copied]
                    )
    versions = summary.get("versions", {})
    running = ", ".join(f"{name} {value}" for name, value in versions.items())
    text = [f"census of {running}" if running else "census", ""]
    text += ["rank 0; fresh = handed to the backend for the first time (a registration on XPU)", *report.align(lines)]
    text.append("")
    for fix, run in summary["runs"].items():
        for index, request in enumerate(run["ranks"][0]["requests"], start=1):
            timeline = " > ".join(request["timeline"])
            counts = f"{request['releases']} release(s), {request['barrier_temps']} barrier temp(s)"
            text.append(f"{fix}, request {index}: {counts}; {timeline}")
    text += ["", *format_compile(summary)]
    text.append("")
    text.append("unmanaged sites (a device group's backend handed anything but persistent blocks), every rank:")
    for run, sites in summary["unmanaged_sites"].items():
        text.append(f"{run:>7}: {sum(sites.values())} call(s) at {len(sites)} site(s)")
        text += [f"         {calls:5d} x {site}" for site, calls in sites.items()] if run in ("whole", "pool") else []
    text += [
        "",
        *format_layer(summary),
        *format_pool(summary),
        "",
        *format_memory(summary),
        "",
        *format_timing(summary),
        "",
        *verdicts(summary),
    ]
    proj = summary["projection"]
    if proj is not None:
        text.append("")
        text.append("PROJECTION (not a measurement) to 1344x768, 209 frames, TP 4, real widths; rank 0, per request:")
        text.append(f"  {proj['formula']}")
        for component in COMPONENTS:
            fresh = proj["fresh_MiB_per_request_rank0"][component]
            received = proj["received_MiB_per_request_rank0"][component]
            if received:
                scale = proj["scales"][component]
                text.append(
                    f"  {component:>12}: fresh {fresh:10.1f} MiB with the fix off, received {received:10.1f} MiB "
                    f"(x{scale:.1f})"
                )
        if proj["layer"] is not None:
            layer = proj["layer"]
            text.append(
                f"  whole-request fix: fresh 0 from request 2; workspaces resident {layer['resident_MiB_rank0']:.1f} "
                f"MiB; copies {layer['copied_MiB_per_request_rank0']:.1f} MiB per request, about "
                f"{layer['copy_ms_per_request_rank0']:.1f} ms at an assumed {layer['copy_GBps_assumed']:.0f} GB/s"
            )
    groups = " and ".join(f"({', '.join(group)})" for group in summary["media_groups"])
    text.append(f"media identical across the runs {groups}: {summary['media_identical']}")
    return "\n".join(text)


def format_pool(summary: dict[str, Any]) -> list[str]:
    """The request pool, per rank: whether each request's forward ran in the worker's pool, and device-group calls made
    while no request ran in it (by component)."""
    run = summary["runs"].get("pool")
    if run is None:
        return []
    text = ["", "the request pool, per rank: request forwards run in the pool; device-group calls made outside it"]
    for rank in run["ranks"]:
        inside = [bool(p and p["in_pool"]) for p in rank["pool"]]
        outside = [sum(request["outside_pool_context"].values()) for request in rank["requests"]]
        text.append(f"  rank {rank['rank']}: in the pool {sum(inside)}/{len(inside)}; outside it per request {outside}")
    text.append(
        "calls in a request handed memory outside the pool, per site, rank 0, request by request: stable (addresses"
        " the first request's calls handed over) / fresh (new since: growth the pool cannot stop)"
    )
    requests = run["ranks"][0]["requests"]
    sites = sorted({site for r in requests for site in (*r["outside_pool_stable"], *r["outside_pool_fresh"])})
    for site in sites:
        counts = [f"{r['outside_pool_stable'].get(site, 0)}/{r['outside_pool_fresh'].get(site, 0)}" for r in requests]
        text.append(f"  {' '.join(counts)}  {site}")
    fresh = [sum(sum(r["outside_pool_fresh"].values()) for r in rank["requests"][1:]) for rank in run["ranks"]]
    text.append(f"  fresh from request 2 on, per rank: {fresh}")
    if summary["config"]["device"] == "cpu":
        text.append(
            "  CPU ranks: the pool is the test platform's stand-in for torch.xpu's (no caching allocator here): its"
            " segments (the memory a request made) answer what the pool holds, and the fresh counts above are the"
            " CPU allocator's; on XPU the pool's own segments answer it"
        )
    return text


def format_layer(summary: dict[str, Any]) -> list[str]:
    """The layer's own figures per rank and request, for the runs that have it."""
    lines = [
        ["run", "req", "rank", "resident MiB", "blocks", "allocs", "staged", "fallbacks", "payload MiB"]
        + ["copied MiB"]
    ]
    for fix, run in summary["runs"].items():
        for rank in run["ranks"]:
            for index, row in enumerate(layer_per_request(rank), start=1):
                lines.append(
                    [
                        fix,
                        str(index),
                        str(rank["rank"]),
                        f"{row['resident_bytes'] / MIB:.2f}",
                        str(row["blocks"]),
                        str(row["block_allocations"]),
                        str(row["staged_calls"]),
                        str(row["fallbacks"]),
                        f"{row['payload_bytes'] / MIB:.2f}",
                        f"{row['staged_bytes'] / MIB:.2f}",
                    ]
                )
    if len(lines) == 1:
        return []
    title = "persistent collectives, per rank and request (resident: as it stands after the request; staged: calls"
    title += " copied through blocks, none with the pool; payload: the callers' tensors staged; copied: into and out"
    title += " of blocks)"
    return [title] + (report.align(lines))


def media_groups(runs: dict[str, Any], dit_compiled: bool) -> list[list[str]]:
    """The runs whose media must be identical: all of them where the DiT runs eagerly. Compiled, staging's graph holds
    the registered ops, around which Inductor fuses the DiT's code otherwise than around torch's functional
    collectives: its media are the release's once decoded, to the last bits of some pixels (``media_difference``)."""
    if not dit_compiled or "whole" not in runs:
        return [list(runs)]
    return [["whole"], [name for name in runs if name != "whole"]]


def media_difference(media: dict[str, list[bytes]]) -> dict[str, list[dict[str, float]]]:
    """Per request, how far each run's media are from the release's once decoded; empty without the release."""
    if "release" not in media:
        return {}
    return {
        name: [serve_cpu.media_difference(mine, theirs) for mine, theirs in zip(got, media["release"], strict=True)]
        for name, got in media.items()
        if name != "release"
    }


def paired_runs(runs: dict[str, Any]) -> tuple[str, str] | None:
    """The two runs served side by side: the whole fix staged, and the one run beside it (the VAE's only, else the
    release), as ``PIPELINE_RUNS`` orders them."""
    beside = next((name for name in ("vae", "release") if name in runs), None)
    return ("whole", beside) if "whole" in runs and beside is not None else None


def paired_timing(runs: dict[str, Any]) -> dict[str, Any] | None:
    """Whole fix / off, per rank (wall and CPU) and at the client, over the requests after the first."""
    paired = paired_runs(runs)
    if paired is None:
        return None
    on, off = (runs[name] for name in paired)  # the layer on, the layer off
    skip = 1 if len(on["request_wall_s"]) >= 3 else 0  # request 1 warms both up, when there are pairs to spare
    if len(on["request_wall_s"]) - skip < 2:
        return None
    result = {"client_wall": stats.paired_ratio(on["request_wall_s"][skip:], off["request_wall_s"][skip:]).as_dict()}
    for rank_on, rank_off in zip(on["ranks"], off["ranks"], strict=True):
        for key in ("wall_s", "cpu_s"):
            mine = [t[key] for t in rank_on["timing"][skip:]]
            theirs = [t[key] for t in rank_off["timing"][skip:]]
            result[f"rank{rank_on['rank']}_{key}"] = stats.paired_ratio(mine, theirs).as_dict()
    return result


def format_timing(summary: dict[str, Any]) -> list[str]:
    """Seconds per request, client wall and each rank's wall and CPU, then the paired ratios whole / vae."""
    where = f"{os.cpu_count()} CPU core(s), {serve_cpu.WORLD} ranks per server"
    pair = paired_runs(summary["runs"]) or ()
    order = f"{' and '.join(pair)} served side by side, in alternating order"
    text = [f"seconds per request ({where}; {order if summary['config']['side_by_side'] else 'servers in turn'})"]
    lines = [["run", "req", "client wall", *(f"rank {r} wall / CPU" for r in range(serve_cpu.WORLD))]]
    for fix, run in summary["runs"].items():
        for index, client in enumerate(run["request_wall_s"]):
            ranks = [f"{r['timing'][index]['wall_s']:.2f} / {r['timing'][index]['cpu_s']:.2f}" for r in run["ranks"]]
            lines.append([fix, str(index + 1), f"{client:.2f}", *ranks])
    text += report.align(lines)
    paired = summary["paired_timing"]
    if not summary["config"]["side_by_side"]:
        text.append("no paired ratio: the servers ran in turn (one server holds the cards)")
        return text
    if paired is None:
        text.append("no paired ratio: it needs at least 2 requests after the first (--requests 3)")
        return text
    pairs = next(iter(paired.values()))["pairs"]
    caution = "; with fewer than 5 pairs the interval says little" if pairs < 5 else ""
    text.append(f"{pair[0]} / {pair[1]}, paired by request (target: at most 1.02x{caution}):")
    for key, estimate in paired.items():
        text.append(f"  {key:>12}: {stats.describe(stats.Estimate(**estimate))}")
    return text


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    proj = summary["projection"]
    fig, axes = plt.subplots(1, 2 if proj else 1, figsize=(14 if proj else 9, 4.5), squeeze=False)
    ax = axes[0][0]
    runs = summary["runs"]
    requests = len(next(iter(runs.values()))["ranks"][0]["requests"])
    width = 0.8 / len(runs)
    colours = dict(zip(COMPONENTS, ("C0", "C1", "C2", "C3", "C7"), strict=True))
    for position, (fix, hatch) in enumerate(zip(runs, ("", "//", ".."), strict=False)):
        offset = (position - (len(runs) - 1) / 2) * width
        bottom = [0.0] * requests
        for component, colour in colours.items():
            values = [by_component(r)[component]["fresh_bytes"] / MIB for r in runs[fix]["ranks"][0]["requests"]]
            label = f"{component} ({fix})" if any(values) else None
            positions = [i + 1 + offset for i in range(requests)]
            ax.bar(positions, values, width * 0.95, bottom=bottom, color=colour, hatch=hatch, label=label)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    title = "MEASURED: fresh bytes handed to collectives, rank 0 (synthetic pipeline)"
    ax.set(xlabel=f"request (bars left to right: {', '.join(runs)})", ylabel="MiB", title=title)
    if proj is None:
        report.save(fig, [ax], path)
        return
    # Beside it, the same books at the seed's geometry: per request from request 2 on (the last request's).
    seed_ax = axes[0][1]
    bottom = [0.0] * len(runs)
    for component, colour in colours.items():
        values = [
            by_component(run["ranks"][0]["requests"][-1])[component]["fresh_bytes"] * proj["scales"][component] / MIB
            for run in runs.values()
        ]
        positions = list(range(1, len(runs) + 1))
        seed_ax.bar(positions, values, 0.6, bottom=bottom, color=colour, label=component if any(values) else None)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    seed_ax.set(
        xlabel="run: " + ", ".join(f"{i} = {name}" for i, name in enumerate(runs, start=1)),
        ylabel="MiB per request",
        title="PROJECTION (not measured) to 1344x768, 209 frames, TP 4:\nfresh bytes per request from request 2 on",
    )
    report.save(fig, [ax, seed_ax], path)


def _layouts_help() -> str:
    by_layout: dict[str, list[str]] = {}
    for pipeline, layouts in LAYOUTS.items():
        for layout in layouts:
            by_layout.setdefault(layout, []).append(pipeline)
    every = set(LAYOUTS)
    return "DiT parallelism on four ranks: " + "; ".join(
        f"{layout} ({'every pipeline' if set(pipelines) == every else ', '.join(pipelines)})"
        for layout, pipelines in by_layout.items()
    )


EPILOG = (
    "Needs: with --device xpu, the checkpoint (--model) and four idle cards, one rank each (ZE_AFFINITY_MASK picks "
    "which four), VLLM_PLUGINS unset or naming xpu_collective_memory and xpu_collective_census; with --device cpu, "
    "this checkout's CPU set-up (scripts/setup_env.sh). It prints how long it expects to take before it starts. "
    "Exit status: 0 when it served every arm (on cards, whatever the media), 1 when the media of runs that must agree "
    "differ on CPU ranks, 2 on a bad argument."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pipeline_census",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=EPILOG,
    )
    parser.add_argument("--requests", type=int, default=8, help="identical requests per server")
    parser.add_argument(
        "--pipeline",
        choices=tuple(LAYOUTS),
        default=None,
        help="the synthetic pipeline served, minimax_h3 where not given; with --model, its model_index.json's",
    )
    layouts = sorted({layout for by_pipeline in LAYOUTS.values() for layout in by_pipeline})
    parser.add_argument("--layout", choices=layouts, default="tp", help=_layouts_help())
    parser.add_argument(
        "--without-vae-run",
        action="store_true",
        help="MiniMax-H3: serve no VAE-only run (it isolates the tile gather)",
    )
    parser.add_argument(
        "--without-pool-run",
        action="store_true",
        help="serve no request-pool run (VLLM_OMNI_DIFFUSION_REQUEST_MEM_POOL=1)",
    )
    parser.add_argument("--output-dir", type=Path, default=Path("out/census"), help="census.json, census.png, logs")
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="where the synthetic pipeline is written; a user cache if not"
    )
    parser.add_argument(
        "--offload",
        choices=tuple(OFFLOAD_FLAGS),
        default="model",
        help="model-level offload (as the seed's runs) or layer-wise offload",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="serve with --enforce-eager (otherwise the DiT compiled, as vLLM-Omni runs it on XPU)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a downloaded MiniMax-H3 FL2VA, Wan2.2 text-to-video or Qwen-Image checkpoint; the synthetic one if not",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "xpu"),
        default="cpu",
        help="cpu: four CPU ranks through the test-only platform; xpu: the installed XPU platform, one rank per card",
    )
    parser.add_argument(
        "--serve-args",
        default=None,
        help="your own vllm-omni serve arguments, quoted as one string, in place of the recipe's flags, --layout "
        "and --offload (keep four ranks); each arm adds only its switches",
    )
    parser.add_argument(
        "--debug-logging",
        action="store_true",
        help="serve at DEBUG, each record with its process id (the VAE gather's per-call receipts); on CPU ranks "
        "always; otherwise your VLLM_LOGGING_LEVEL",
    )
    seeds = (("MiniMax-H3", SEED), ("Wan2.2", WAN_SEED), ("Qwen-Image", QWEN_SEED))
    for name, key in (("height", "height"), ("width", "width"), ("num-frames", "frames"), ("steps", "steps")):
        by_pipeline = ", ".join(
            f"{seed[key]} for {model}" for model, seed in seeds if not (key == "frames" and model == "Qwen-Image")
        )
        parser.add_argument(
            f"--{name}",
            type=int,
            default=None,
            help=f"the request's {name} with --model; if not given, {by_pipeline}",
        )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error(f"--requests={args.requests}: expected an integer >= 1")
    if args.model is not None and not (args.model / "model_index.json").is_file():
        parser.error(f"--model={args.model}: expected a checkpoint directory with a model_index.json")
    if args.device == "xpu":
        import torch

        if not torch.xpu.is_available():
            parser.error("--device xpu: this machine has no XPU that torch can use (torch.xpu.is_available() is False)")
        if args.model is None:
            parser.error("--device xpu needs --model PATH: the synthetic pipeline is for CPU ranks")
    if args.model is not None:
        pipeline = model_pipeline(args.model)
        if pipeline is None:
            parser.error(
                f"--model={args.model}: expected a checkpoint of one of {sorted(CLASS_NAMES)} (model_index.json)"
            )
        if args.pipeline is not None and args.pipeline != pipeline:
            parser.error(f"--pipeline={args.pipeline}: --model={args.model} is a {pipeline} checkpoint")
        args.pipeline = pipeline
    args.pipeline = args.pipeline or "minimax_h3"
    if args.layout not in LAYOUTS[args.pipeline]:
        parser.error(f"--layout={args.layout}: expected one of {sorted(LAYOUTS[args.pipeline])} for {args.pipeline}")
    sizes = {"height": args.height, "width": args.width, "num_frames": args.num_frames, "steps": args.steps}
    for name, value in sizes.items():
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value}: expected a positive integer")
    if args.model is None and any(value is not None for value in sizes.values()):
        parser.error("--height, --width, --num-frames and --steps need --model: the synthetic request is fixed")
    if args.pipeline == "qwen_image" and args.num_frames is not None:
        parser.error(f"--num-frames={args.num_frames}: Qwen-Image makes one image; leave it out")
    if (listed := listed_plugins()) is not None:
        # The arms load the fix and the census by these names; only the release arm leaves the fix out itself.
        missing = [name for name in (PLUGIN, CENSUS_PLUGIN) if name not in listed]
        if missing:
            parser.error(
                f"VLLM_PLUGINS={os.environ['VLLM_PLUGINS']!r}: the A/B needs {' and '.join(missing)} in it too, "
                "or unset it"
            )
    return args


def synthetic_checkpoint(pipeline: str, cache_dir: Path | None) -> Path:
    if pipeline == "qwen_image":
        from tooling.synthetic.qwen_image import build_synthetic_qwen_image

        return build_synthetic_qwen_image(cache_dir)
    if pipeline == "wan2_2":
        from tooling.synthetic.wan2_2 import build_synthetic_wan2_2

        return build_synthetic_wan2_2(cache_dir)
    from tooling.synthetic.pipeline import build_synthetic_pipeline

    return build_synthetic_pipeline(cache_dir)


def model_pipeline(model: Path) -> str | None:
    """The pipeline vLLM-Omni serves a checkpoint with, by its ``model_index.json``; None for any other."""
    return CLASS_NAMES.get(json.loads((model / "model_index.json").read_text()).get("_class_name"))


def seed_request(args: argparse.Namespace) -> dict[str, Any] | None:
    """The request sent to a real checkpoint: its pipeline's seed size and steps unless given; None if synthetic."""
    if args.model is None:
        return None
    seed = {"minimax_h3": SEED, "wan2_2": WAN_SEED, "qwen_image": QWEN_SEED}[args.pipeline]
    request = {
        "height": args.height or seed["height"],
        "width": args.width or seed["width"],
        "num_frames": args.num_frames or seed["frames"],
        "num_inference_steps": args.steps or seed["steps"],
    }
    if args.pipeline == "wan2_2":  # true CFG, so that --layout cfg has both branches to split
        from tooling.synthetic.wan2_2 import REQUEST

        request |= {key: REQUEST[key] for key in ("guidance_scale", "negative_prompt")}
    if args.pipeline == "qwen_image":
        from tooling.synthetic.qwen_image import REQUEST

        request = {key: value for key, value in request.items() if key != "num_frames"}
        request |= {key: REQUEST[key] for key in ("true_cfg_scale", "negative_prompt")}
    return request


# What one start-up and one request take, in seconds: on CPU ranks with the synthetic checkpoints (measured here), and
# the order of a real checkpoint's on cards (a guess until cards report it; the table prints the real times).
CPU_STARTUP_S, CPU_REQUEST_S = 100, 25
CARD_STARTUP_S, CARD_REQUEST_S = 600, 300


def duration_estimate(arms: tuple[str, ...], requests: int, side_by_side: bool, real: bool) -> str:
    """The line printed before any server starts: what will be served, and about how long it takes."""
    startup_s, request_s = (CARD_STARTUP_S, CARD_REQUEST_S) if real else (CPU_STARTUP_S, CPU_REQUEST_S)
    turns = -(-len(arms) // 2) if side_by_side else len(arms)
    per_turn = startup_s + requests * request_s * (2 if side_by_side else 1)
    how = "two at a time" if side_by_side else "one at a time"
    guess = "a real checkpoint's start-up and requests vary: scale by yours" if real else "measured on CPU ranks here"
    return (
        f"{len(arms)} arms ({', '.join(arms)}), {how}, {requests} requests each: about {turns * per_turn / 60:.0f} "
        f"minutes ({guess})"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    request = seed_request(args)
    model = args.model if args.model is not None else synthetic_checkpoint(args.pipeline, args.cache_dir)
    if args.model is None and args.pipeline == "wan2_2":
        from tooling.synthetic.wan2_2 import REQUEST as request
    if args.model is None and args.pipeline == "qwen_image":
        from tooling.synthetic.qwen_image import REQUEST as request
    skipped = {run for run, skip in (("vae", args.without_vae_run), ("pool", args.without_pool_run)) if skip}
    names = tuple(run for run in PIPELINE_RUNS[args.pipeline] if run not in skipped)
    # CPU ranks can share the machine; a server on cards holds them, so the servers then run in turn.
    side_by_side = args.device == "cpu"
    groups = [names[i : i + 2] for i in range(0, len(names), 2)] if side_by_side else [(run,) for run in names]
    where = f"{args.requests} requests on {serve_cpu.WORLD} {args.device.upper()} ranks each"
    estimate = duration_estimate(names, args.requests, side_by_side, real=args.model is not None)
    print(f"[census] {estimate}", file=sys.stderr)
    runs: dict[str, Any] = {}
    for group in filter(None, groups):
        print(f"[census] {args.layout}: run(s) {' and '.join(group)}, {where}", file=sys.stderr)
        runs |= serve_and_count(
            model,
            args.output_dir,
            args.layout,
            group,
            args.requests,
            pipeline=args.pipeline,
            device=args.device,
            request=request,
            real=args.model is not None or args.device != "cpu",
            eager=args.eager,
            offload=args.offload,
            serve_args=tuple(shlex.split(args.serve_args or "")),
            debug_logging=args.debug_logging or args.device == "cpu",
        )
    runs = {name: runs[name] for name in RUNS if name in runs}
    media = {name: run.pop("media") for name, run in runs.items()}
    groups = media_groups(runs, dit_compiled=not args.eager)
    # The projection's formula is the synthetic MiniMax-H3 pipeline's, under TP.
    synthetic_tp = args.layout == "tp" and args.model is None and args.pipeline == "minimax_h3"
    summary = {
        "config": {
            "pipeline": args.pipeline,
            "layout": args.layout,
            "requests": args.requests,
            "world_size": serve_cpu.WORLD,
            "runs": {name: RUNS[name] for name in runs},
            "device": args.device,
            "model": str(model),
            "request": request,
            "side_by_side": side_by_side,
            "dit_compile": not args.eager,
            "offload": args.offload,
        },
        "versions": {p: version(p) for p in (PROJECT_DIST, "vllm-omni", "torch")},
        "runs": runs,
        "media_identical": all(len({tuple(runs[name]["media_sha256"]) for name in group}) == 1 for group in groups),
        "media_groups": groups,
        "media_difference": media_difference(media),
        "compile": compile_summary(runs),
        "unmanaged_sites": unmanaged_sites(runs),
        "memory_growth": memory_growth(runs),
        "paired_timing": paired_timing(runs) if side_by_side else None,
        # The release's books carry every collective's plain shape.
        "projection": projection(runs["release"], runs["whole"]) if synthetic_tp else None,
    }
    (args.output_dir / "census.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.output_dir / "census.png")
    print(format_table(summary))
    print(f"[census] wrote {args.output_dir / 'census.json'} and {args.output_dir / 'census.png'}", file=sys.stderr)
    if not summary["media_identical"]:
        if args.device != "cpu":  # a device's kernels need not be deterministic run to run; CPU's are here
            print("[census] note: media differ between the runs (not required on a device)", file=sys.stderr)
            return 0
        print("[census] FAIL: media differ between the runs", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
