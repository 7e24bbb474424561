# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The collective census: fresh and persistent buffers on a real one-rank gloo group, attribution of callers to
pipeline components, and its strict switch."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from xpu_collective_memory import census
from xpu_collective_memory.ledger import CollectiveLedger

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


@pytest.fixture(scope="module")
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _books(report, site_prefix):
    ((books,),) = [[b for site, b in sites.items() if site.startswith(site_prefix)] for sites in report.books.values()]
    return books


def test_a_buffer_new_each_request_is_fresh_and_one_kept_across_a_release_is_persistent(one_rank_group):
    kept = torch.zeros(1024)
    with CollectiveLedger(limit=None) as ledger:
        for _ in range(3):
            dist.all_reduce(kept)
            ledger.mark_release()  # where an accelerator run would empty the cache
            dist.broadcast(torch.ones(1024), src=0)
            reports = ledger.end_request()
    first, *later = ledger.requests
    assert _books(first, "all_reduce")["fresh_buffers"] == 1
    for report in later:
        books = _books(report, "all_reduce")
        assert (books["fresh_buffers"], books["persistent_buffers"], books["reused_buffers"]) == (0, 1, 0)
    for report in ledger.requests:
        fresh = _books(report, "broadcast")
        assert fresh["fresh_buffers"] == 1 and fresh["fresh_bytes"] == 4096 and fresh["persistent_buffers"] == 0
        assert fresh["bytes_sent"] == fresh["bytes_received"] == 4096 and fresh["shapes"] == ["float32[1024]"]
        assert report.releases == 1 and report.timeline == ["all", "release", "all"]
    assert reports is ledger.requests[-1]


def test_a_buffer_used_twice_in_one_window_is_reused_not_fresh(one_rank_group):
    buffer = torch.zeros(16)
    with CollectiveLedger(limit=None) as ledger:
        for _ in range(2):
            dist.all_reduce(buffer)
        report = ledger.end_request()
    books = _books(report, "all_reduce")
    assert (books["calls"], books["fresh_buffers"], books["reused_buffers"], books["persistent_buffers"]) == (
        2,
        1,
        1,
        0,
    )


def _frame_from(path: str, qualname: str, inner: tuple[str, str] | None = None):
    """A real frame whose code claims ``path`` and ``qualname``; ``inner`` is called from it, innermost first."""
    namespace: dict = {"sys": sys, "_inner": None}
    for file, name in [inner, (path, qualname)] if inner else [(path, qualname)]:
        short = name.rpartition(".")[2]
        body = "return callee() if callee else sys._getframe()"
        exec(compile(f"def {short}(callee=_inner):\n    {body}\n", file, "exec"), namespace)
        namespace[short].__code__ = namespace[short].__code__.replace(co_qualname=name)
        namespace["_inner"] = namespace[short]
    return namespace["_inner"]()


SITE = "/venv/site-packages/vllm_omni/diffusion/models/minimax_h3"
REMOTE = "/root/.cache/huggingface/modules/transformers_modules/video_vae"
WAN = "/venv/site-packages/vllm_omni/diffusion"


@pytest.mark.parametrize(
    "path,qualname,inner,component",
    [
        (f"{SITE}/encoder.py", "MiniMaxH3Qwen3VLEncoder.forward", None, "text_encoder"),
        (
            f"{SITE}/pipeline_minimax_h3.py",
            "MiniMaxH3Pipeline.encode_prompt",
            (f"{SITE}/pipeline_minimax_h3.py", "_broadcast_tensor"),
            "text_encoder",
        ),
        (f"{SITE}/minimax_h3_transformer.py", "MiniMaxH3DiTModel.forward", None, "dit"),
        (f"{REMOTE}/klvae.py", "AutoencoderKL._all_gather_tiled_results", None, "video_vae"),
        (
            f"{REMOTE}/klvae.py",
            "AutoencoderKL.tiled_decode",
            (f"{REMOTE}/parallel.py", "all_gather_var_shape"),
            "video_vae",
        ),
        (f"{SITE}/vae_gather.py", "TileGatherReuse.__call__", None, "video_vae"),
        (f"{SITE}/vae.py", "MiniMaxH3VideoVAE.decode_latent", None, "video_vae"),
        (f"{SITE}/vae.py", "MiniMaxH3AudioVAE.decode", None, "audio_vae"),
        ("/x/audio_vae/modeling_minimax_h3_audio_vae.py", "AudioAutoencoder.decode", None, "audio_vae"),
        ("/venv/site-packages/vllm_omni/diffusion/worker/diffusion_worker.py", "WorkerProc.run", None, "other"),
        (f"{WAN}/models/wan2_2/pipeline_wan2_2.py", "Wan22Pipeline.encode_prompt", None, "text_encoder"),
        (
            f"{WAN}/models/wan2_2/wan2_2_transformer.py",
            "WanTransformer3DModel.forward",
            (f"{WAN}/distributed/comm.py", "all_to_all_4D"),
            "dit",
        ),
        (
            f"{WAN}/models/wan2_2/pipeline_wan2_2.py",
            "Wan22Pipeline.diffuse",
            (f"{WAN}/distributed/cfg_parallel.py", "CFGParallelMixin.predict_noise_maybe_with_cfg"),
            "dit",
        ),
        (
            f"{WAN}/models/wan2_2/pipeline_wan2_2.py",
            "Wan22Pipeline.forward",
            (f"{WAN}/distributed/autoencoders/distributed_vae_executor.py", "DistributedVaeExecutor.gather_tensors"),
            "video_vae",
        ),
    ],
)
def test_each_collective_is_attributed_to_the_component_of_its_innermost_named_caller(path, qualname, inner, component):
    assert census.classify(_frame_from(path, qualname, inner)) == component


def test_the_census_switch_is_strict(monkeypatch, tmp_path):
    monkeypatch.delenv(census.CENSUS_ENV, raising=False)
    assert census.census_dir() is None
    for bad in ("", " ", str(tmp_path / "missing")):
        monkeypatch.setenv(census.CENSUS_ENV, bad)
        with pytest.raises(ValueError, match=f"{census.CENSUS_ENV}={bad!r} is not an existing directory"):
            census.census_dir()
    monkeypatch.setenv(census.CENSUS_ENV, str(tmp_path))
    assert census.census_dir() == tmp_path


def test_without_the_switch_the_plugin_hooks_nothing(monkeypatch):
    from vllm_omni.diffusion.models.minimax_h3 import pipeline_minimax_h3
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
    from vllm_omni.platforms import current_omni_platform

    monkeypatch.delenv(census.CENSUS_ENV, raising=False)
    census.register()
    chain = [pipeline_minimax_h3.MiniMaxH3Pipeline.forward]  # the release's own, under its own decorators only
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    assert chain[-1].__code__.co_filename == pipeline_minimax_h3.__file__
    assert not any(hasattr(fn, census._MARK) for fn in chain)
    assert not hasattr(DiffusionModelRunner.load_model, census._MARK)
    assert not hasattr(torch.accelerator.empty_cache, census._MARK)
    assert not hasattr(getattr(type(current_omni_platform), "empty_cache", None), census._MARK)


def test_an_empty_cache_inside_another_closes_one_release_window_not_two():
    with CollectiveLedger(limit=None) as ledger:
        mark = census._marking_releases(ledger)
        inner = mark(lambda: None)
        outer = mark(lambda: inner())  # the platform's empty_cache calling torch's
        outer()
        inner()
        report = ledger.end_request()
    assert report.releases == 2


def test_qualname_before_python_3_11_comes_from_the_class_of_self_or_cls():
    from types import SimpleNamespace

    code = SimpleNamespace(co_name="decode_latent")  # no co_qualname, as on Python 3.10

    class MiniMaxH3VideoVAE:
        pass

    assert census.qualname(code, {"self": MiniMaxH3VideoVAE()}).endswith("MiniMaxH3VideoVAE.decode_latent")
    assert census.qualname(code, {"cls": MiniMaxH3VideoVAE}).endswith("MiniMaxH3VideoVAE.decode_latent")
    assert census.qualname(code, {}) == "decode_latent"
    assert census.qualname(test_qualname_before_python_3_11_comes_from_the_class_of_self_or_cls.__code__, {}) == (
        "test_qualname_before_python_3_11_comes_from_the_class_of_self_or_cls"
    )
