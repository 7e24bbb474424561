# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""``vllm-omni serve`` on CPU ranks with a synthetic pipeline, and an HTTP client for it.

CPU ranks need the test-only vLLM-Omni platform in ``tests/cpu_platform`` (``scripts/setup_env.sh`` installs
it into the CPU venvs; the product never does). Run as a script, it serves a tiny checkpoint, sends one
request and prints where the fix was applied: MiniMax-H3 text-to-video+audio (TP 4) by default, or Wan2.2
text-to-video (Ulysses 4) with ``--pipeline wan2_2``:

    python -m tooling.serve_cpu --output-dir out/serve_cpu
    python -m tooling.serve_cpu --pipeline wan2_2 --output-dir out/serve_cpu_wan2_2

``VLLM_OMNI_PERSISTENT_COLLECTIVES`` in the environment picks staging (default ``1`` here);
``VLLM_OMNI_DIFFUSION_REQUEST_MEM_POOL=1`` runs each request in the worker's private memory pool instead (here the
CPU test platform's stand-in for it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORLD = 4
SERVE_FLAGS = (
    "--omni",
    "--trust-remote-code",
    f"--tensor-parallel-size={WORLD}",
    f"--vae-patch-parallel-size={WORLD}",
    "--vae-parallel-mode=tile",
    "--vae-use-tiling",
    "--enable-cpu-offload",
)
# Wan2.2 on the same ranks: Ulysses 4 in place of TP (its attention all-to-alls run in its compiled blocks).
WAN2_2_FLAGS = tuple(f for f in SERVE_FLAGS if not f.startswith(("--tensor-parallel-size", "--trust"))) + (
    f"--usp={WORLD}",
)
RECEIPT_LOGGING = {
    "VLLM_LOGGING_LEVEL": "DEBUG",  # the gather's per-call receipts
    # vLLM writes its "(Worker pid=N) " prefix apart from the record, so concurrent workers can detach it from
    # its line; a process id the formatter puts inside the record cannot be.
    "VLLM_LOGGING_PREFIX": "[record pid=%(process)d] ",
}

RECEIPTS = {
    "plugin_hooks": r"\[XPU_COLLECTIVE_MEMORY\] hooked ",
    "installs": r"\[H3_VAE_GATHER\] tile gather reuse installed ",
    "gathers": r"\[H3_VAE_GATHER\] reuse=(?:alloc|hit) ",
    "workspace_allocs": r"\[H3_VAE_GATHER\] reuse=alloc ",
    "empty_cache": r"\[CPU_TEST_PLATFORM\] empty_cache #",
    "layer_installs": r"\[PERSISTENT_COLLECTIVES\] persistent buffers in use in this process ",
    "dit_compile": r"Regional compilation applied to \d+ module",  # vLLM-Omni's own line: Inductor, lazy
    "pools_made": r"\[MEM_POOL_STAND_IN\] MemPool \(\d+, \d+\) made ",
    "pool_entries": r"\[MEM_POOL_STAND_IN\] MemPool \(\d+, \d+\) in use ",
    "worker_off": r"\[XPU_COLLECTIVE_MEMORY\] off in this process ",
}
SWITCH_ENV = "VLLM_OMNI_PERSISTENT_COLLECTIVES"
POOL_ENV = "VLLM_OMNI_DIFFUSION_REQUEST_MEM_POOL"
# The log tags of the plugin, the VAE gather and staging: where the fix says it applied.
FIX_TAGS = ("[XPU_COLLECTIVE_MEMORY]", "[H3_VAE_GATHER]", "[PERSISTENT_COLLECTIVES]")


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log_path: Path

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def serve(
    model: Path,
    log_path: Path,
    *,
    reuse: str,
    flags: tuple[str, ...] = SERVE_FLAGS,
    env: dict[str, str] | None = None,
    startup_s: float = 600,
    device: str = "cpu",
    receipt_logging: bool = True,
) -> Iterator[Server]:
    """Start the server in its own session, wait for ``/health``, and on exit stop it and every child.

    ``device="cpu"`` serves on CPU ranks through the test-only platform; ``"xpu"`` on the installed XPU
    platform, one rank per card. ``receipt_logging``: DEBUG records, each with its process id, for the fix's
    receipts; else the logging the environment sets. Raises if it does not become healthy, or if a process of its
    session outlives the stop by 60 s.
    """
    import requests

    on_cpu = {
        "VLLM_OMNI_CPU_TEST_PLATFORM": "1",
        "OMP_NUM_THREADS": "1",  # four ranks share two cores
    }
    fixes = {
        "VLLM_OMNI_H3_VAE_GATHER_REUSE": reuse,
        "VLLM_OMNI_PERSISTENT_COLLECTIVES": reuse,  # the whole-request fix goes with the VAE's unless env says
    }
    logging = RECEIPT_LOGGING if receipt_logging else {}  # else the operator's own level and format
    env = os.environ | (on_cpu if device == "cpu" else {}) | fixes | logging | (env or {})
    for attempt in range(1, PORT_RACE_ATTEMPTS + 1):
        port = _free_port()
        command = [str(Path(sys.executable).with_name("vllm-omni")), "serve", str(model)]
        command += ["--host=127.0.0.1", f"--port={port}", *flags]
        log_file = log_path.open("w")
        process = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        server = Server(process, port, log_path)
        try:
            if _became_healthy(server, startup_s, requests, last_attempt=attempt == PORT_RACE_ATTEMPTS):
                break
        except BaseException:
            stop(server)
            log_file.close()
            raise
        stop(server)
        log_file.close()
    try:
        yield server
    finally:
        stop(server)
        log_file.close()


PORT_RACE_ATTEMPTS = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _became_healthy(server: Server, startup_s: float, requests, *, last_attempt: bool) -> bool:
    """Wait for ``/health``. ``False`` when the server exited because a port it was given (its HTTP port or one vLLM
    picked for its ranks) was taken between being chosen and being bound, and another start may try."""
    deadline = time.monotonic() + startup_s
    while True:
        if server.process.poll() is not None:
            log = server.log()
            if not last_attempt and "address already in use" in log.lower():
                return False
            raise RuntimeError(f"vllm-omni serve exited with {server.process.returncode}:\n{log[-4000:]}")
        with contextlib.suppress(requests.ConnectionError):
            if requests.get(server.url("/health"), timeout=5).status_code == 200:
                return True
        if time.monotonic() > deadline:
            raise TimeoutError(f"vllm-omni serve not healthy after {startup_s} s:\n{server.log()[-4000:]}")
        time.sleep(2)


def stop(server: Server, grace_s: float = 60) -> None:
    """SIGTERM the server, as an operator's Ctrl-C would; kill what is left of its session after ``grace_s``."""
    group = server.process.pid  # the session leader's pid is the group id
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            server.process.wait()
            return
        server.process.poll()
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    raise RuntimeError(f"processes of vllm-omni serve (group {group}) were still running {grace_s} s after SIGTERM")


def request_video(server: Server, prompt: str, seed: int, request: dict | None = None, timeout_s: float = 600) -> bytes:
    """One synchronous text-to-video request (MiniMax-H3's synthetic one unless given); returns the MP4."""
    import requests

    from .synthetic.pipeline import REQUEST

    fields = {"prompt": prompt, "seed": seed, **(REQUEST if request is None else request)}
    response = requests.post(
        server.url("/v1/videos/sync"), files={k: (None, str(v)) for k, v in fields.items()}, timeout=timeout_s
    )
    if response.status_code != 200:
        raise RuntimeError(f"POST /v1/videos/sync -> {response.status_code}: {response.text[:2000]}")
    return response.content


def scrape(server: Server, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of the metric ``name`` on the server's ``/metrics``, by their labels."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(server.url("/metrics"), timeout=30).text
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def request_image(server: Server, prompt: str, seed: int, request: dict, timeout_s: float = 600) -> bytes:
    """One text-to-image request (``request``: height, width and the pipeline's fields); returns the PNG."""
    import base64

    import requests

    fields = {key: value for key, value in request.items() if key not in ("height", "width")}
    body = {"prompt": prompt, "seed": seed, "n": 1, "size": f"{request['width']}x{request['height']}", **fields}
    response = requests.post(server.url("/v1/images/generations"), json=body, timeout=timeout_s)
    if response.status_code != 200:
        raise RuntimeError(f"POST /v1/images/generations -> {response.status_code}: {response.text[:2000]}")
    return base64.b64decode(response.json()["data"][0]["b64_json"])


@dataclass(frozen=True)
class Media:
    width: int
    height: int
    frames: int
    audio_channels: int
    audio_sample_rate: int


def media_info(mp4: bytes) -> Media:
    """The video's size and frames, and its audio's channels and rate (0 and 0 without audio)."""
    import av

    with av.open(io.BytesIO(mp4)) as container:
        video = container.streams.video[0]
        audio = container.streams.audio[0] if container.streams.audio else None
        frames = sum(1 for _ in container.decode(video=0))
        channels, rate = (audio.channels, audio.rate) if audio is not None else (0, 0)
        return Media(video.codec_context.width, video.codec_context.height, frames, channels, rate)


def _decoded(media: bytes) -> tuple[Any, Any]:
    """A video's frames (RGB, uint8) and its audio samples (float), or an image as one frame, decoded."""
    import av
    import numpy as np

    if media.startswith(b"\x89PNG"):
        from PIL import Image

        return np.asarray(Image.open(io.BytesIO(media)).convert("RGB"))[None], np.zeros(0)
    with av.open(io.BytesIO(media)) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
        has_audio = bool(container.streams.audio)
    if not has_audio:  # Wan2.2's videos
        return frames, np.zeros(0)
    with av.open(io.BytesIO(media)) as container:
        chunks = [f.to_ndarray().astype(np.float64).reshape(-1) for f in container.decode(audio=0)]
    return frames, np.concatenate(chunks)


def media_difference(first: bytes, second: bytes) -> dict[str, float]:
    """How far two videos are apart once decoded, in dB (inf where equal): the peak signal-to-noise ratio of their
    frames, and the signal-to-noise ratio of the first's audio against the second's. Compiled code may round the last
    bits otherwise, and diffusion steps and lossy audio coding carry that on."""
    import numpy as np

    (frames_a, audio_a), (frames_b, audio_b) = _decoded(first), _decoded(second)
    if frames_a.shape != frames_b.shape or audio_a.shape != audio_b.shape:
        return {"psnr_db": 0.0, "audio_snr_db": 0.0}
    mse = float(np.mean((frames_a.astype(np.float64) - frames_b.astype(np.float64)) ** 2))
    noise = float(np.sum((audio_a - audio_b) ** 2))
    return {
        "psnr_db": float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse)),
        "audio_snr_db": float("inf") if noise == 0 else float(10 * np.log10(float(np.sum(audio_b**2)) / noise)),
    }


def _without_colours(log: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", log)


def receipts(log: str) -> Counter[str]:
    """How often each receipt of the fix (and of the platform's ``empty_cache``) appears in a server log."""
    plain = _without_colours(log)
    return Counter({name: len(re.findall(pattern, plain)) for name, pattern in RECEIPTS.items()})


def receipt_pids(log: str, name: str) -> Counter[int]:
    """How often each process (by the process id its records carry) wrote the receipt ``name``."""
    pattern = re.compile(r"\[record pid=(\d+)\] .*" + RECEIPTS[name])
    return Counter(int(m.group(1)) for line in _without_colours(log).splitlines() if (m := pattern.search(line)))


def receipt_lines(log: str) -> list[str]:
    return [line for line in _without_colours(log).splitlines() if any(tag in line for tag in FIX_TAGS)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tooling.serve_cpu",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Needs: this checkout's CPU set-up (scripts/setup_env.sh installs the test-only CPU platform); about "
        "two minutes on two cores. Exit status: 0 when every worker applied the fix and the request returned media, "
        "1 when not, 2 on a bad argument.",
    )
    parser.add_argument("--output-dir", type=Path, default=Path("out/serve_cpu"), help="the server's log")
    parser.add_argument("--prompt", default="a red fox running through fresh snow", help="the request's prompt")
    parser.add_argument("--pipeline", choices=("minimax_h3", "wan2_2"), default="minimax_h3", help="what is served")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    if args.pipeline == "wan2_2":
        return _serve_wan2_2(args)
    from .synthetic.pipeline import build_synthetic_pipeline

    model = build_synthetic_pipeline()
    print(f"[serve_cpu] serving {model} on {WORLD} CPU ranks (takes about a minute to start)", file=sys.stderr)
    pooled = os.environ.get(POOL_ENV, "0").strip() == "1"
    switch = os.environ.get(SWITCH_ENV, "0" if pooled else "1")
    env = {SWITCH_ENV: switch, POOL_ENV: "1" if pooled else "0"}
    with serve(model, args.output_dir / "server.log", reuse="1", env=env) as server:
        mp4 = request_video(server, args.prompt, seed=0)
    (args.output_dir / "t2va.mp4").write_bytes(mp4)
    log = (args.output_dir / "server.log").read_text(errors="replace")
    counts = receipts(log)
    lines = receipt_lines(log)
    print("where the fix was applied (from the server log):")
    for kind in ("] hooked", "reuse installed", "reuse=alloc"):
        print(*(f"  {line}" for line in lines if kind in line), sep="\n")
    gathers, allocs = counts["gathers"], counts["workspace_allocs"]
    print(f"  ... {gathers} tile gathers served by the reused workspace in all, {allocs} workspace allocation(s)")
    if pooled:
        made, entered = receipt_pids(log, "pools_made"), receipt_pids(log, "pool_entries")
        print(f"  request pool ({POOL_ENV}=1): pools made per worker {sorted(made.values())}, ", end="")
        print(f"requests entered per worker {sorted(entered.values())}")
    print(f"video: {media_info(mp4)} -> {args.output_dir / 't2va.mp4'}")
    in_pool = not pooled or sorted(receipt_pids(log, "pools_made").values()) == [1] * WORLD
    return 0 if counts["installs"] == WORLD and counts["gathers"] > 0 and in_pool else 1


def _serve_wan2_2(args: argparse.Namespace) -> int:
    from .synthetic.wan2_2 import REQUEST, build_synthetic_wan2_2

    model = build_synthetic_wan2_2()
    print(f"[serve_cpu] serving {model} on {WORLD} CPU ranks (takes about a minute to start)", file=sys.stderr)
    with serve(model, args.output_dir / "server.log", reuse="1", flags=WAN2_2_FLAGS) as server:
        mp4 = request_video(server, args.prompt, 0, REQUEST)
    (args.output_dir / "t2v.mp4").write_bytes(mp4)
    log = _without_colours((args.output_dir / "server.log").read_text(errors="replace"))
    print("where the fix was applied (from the server log):")
    print(*(f"  {line}" for line in receipt_lines(log)), sep="\n")
    print(f"video: {media_info(mp4)} -> {args.output_dir / 't2v.mp4'}")
    return 0 if len(receipt_pids(log, "layer_installs")) == WORLD else 1


if __name__ == "__main__":
    sys.exit(main())
