# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The ``vllm_omni.general_plugins`` entry point, found from installed metadata and run by vLLM-Omni's loader.

Loading plugins patches a class for the rest of the process, so each scenario runs in a fresh process.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
from importlib.metadata import PathDistribution, entry_points, version

import pytest

from tests.utils import REPO_ROOT, results_or_raise, run_ranks, use_working_tree
from tooling.synthetic import build_synthetic_checkpoint
from xpu_collective_memory import overlay, plugin

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.integration]


def _load_plugins_and_build(rank: int, world: int, component: str, plugins: str | None) -> dict:

    from tooling import harness
    from vllm_omni.diffusion.models.minimax_h3.vae import MiniMaxH3VideoVAE
    from vllm_omni.diffusion.models.minimax_h3.vae_gather import REUSE_ENV, get_tile_gather
    from vllm_omni.plugins import load_omni_general_plugins

    if plugins is None:
        os.environ.pop("VLLM_PLUGINS", None)
    else:
        os.environ["VLLM_PLUGINS"] = plugins
    os.environ.pop(REUSE_ENV, None)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("vllm_omni.plugins.xpu_collective_memory").addHandler(handler)  # the plugin's and renamed's

    load_omni_general_plugins()
    hooked = getattr(MiniMaxH3VideoVAE.__init__, "_minimax_h3_tile_gather_hook", False)
    auto = harness.load_video_vae(component)
    os.environ[REUSE_ENV] = "1"
    forced = harness.load_video_vae(component)

    # Loaded again, as vLLM-Omni may do in one process: still one hook, still one install per adapter.
    import vllm_omni.plugins

    vllm_omni.plugins.omni_plugins_loaded = False
    load_omni_general_plugins()
    plugin.register()
    again = harness.load_video_vae(component)
    return {
        "hooked": hooked,
        "wrapped_once": not hasattr(MiniMaxH3VideoVAE.__init__.__wrapped__, "__wrapped__"),
        "auto_installed": get_tile_gather(auto) is not None,
        "forced_installed": get_tile_gather(forced) is not None,
        "again_installed": get_tile_gather(again) is not None,
        "forced_untouched": "_all_gather_tiled_results" not in vars(forced.model),
        "messages": [m for m in messages if "[XPU_COLLECTIVE_MEMORY]" in m],
    }


def _adapter_with_everything_off(rank: int, world: int) -> dict:
    os.environ.pop("VLLM_PLUGINS", None)
    os.environ.update({"VLLM_OMNI_H3_VAE_GATHER_REUSE": "0", "VLLM_OMNI_PERSISTENT_COLLECTIVES": "0"})
    from vllm_omni.diffusion.models.minimax_h3.vae import MiniMaxH3VideoVAE
    from vllm_omni.plugins import load_omni_general_plugins

    before = dict(vars(MiniMaxH3VideoVAE))
    load_omni_general_plugins()
    return {"changed": _changed(before, vars(MiniMaxH3VideoVAE))}


@pytest.fixture(scope="module")
def component(tmp_path_factory) -> str:
    return str(build_synthetic_checkpoint(tmp_path_factory.mktemp("h3")))


@pytest.fixture(scope="module")
def loaded(component) -> dict[str, dict]:
    """vLLM-Omni's loader in a fresh process, by ``VLLM_PLUGINS``: unset, without ours, ours under its old name."""
    plugins = {"unset": None, "without ours": "some_other_plugin", "old name": "minimax_h3_vae_gather"}
    scenarios = {key: (_load_plugins_and_build, component, value) for key, value in plugins.items()}
    return _started_together({**scenarios, "everything off": (_adapter_with_everything_off,)})


def test_entry_points_new_and_old_names_come_from_the_installed_distribution_metadata():
    from xpu_collective_memory import census

    found = {ep.name: ep for ep in entry_points(group="vllm_omni.general_plugins")}
    expected = {
        "xpu_collective_memory": plugin.register,
        "xpu_collective_census": census.register,
        "minimax_h3_vae_gather": plugin.register_minimax_h3_vae_gather,
        "minimax_h3_census": census.register_minimax_h3_census,
    }
    for name, function in expected.items():
        assert found[name].dist.name == "vllm-omni-xpu-collective-memory"
        assert found[name].load() is function


def test_vllm_omni_loader_hooks_the_adapter_once_and_the_env_decides_the_install(loaded):
    report = _outcome(loaded, "unset")
    assert report["hooked"] and report["wrapped_once"]
    assert not report["auto_installed"]  # auto mode: XPU only
    assert report["forced_installed"] and report["again_installed"]
    loaded_line, hooked = report["messages"]
    ours = f"vllm-omni-xpu-collective-memory {version('vllm-omni-xpu-collective-memory')}"
    running = f"{ours} on vllm-omni {version('vllm-omni')}"
    assert loaded_line == f"[XPU_COLLECTIVE_MEMORY] loaded: {running} (VLLM_OMNI_PERSISTENT_COLLECTIVES=auto, " + (
        "VLLM_OMNI_DIFFUSION_REQUEST_MEM_POOL=0)"
    )
    assert "hooked vllm_omni.diffusion.models.minimax_h3.vae.MiniMaxH3VideoVAE.__init__" in hooked
    assert hooked.endswith(f"({running})")


def test_with_the_gather_and_staging_off_the_adapter_class_is_as_released(loaded):
    assert _outcome(loaded, "everything off") == {"changed": []}


_REQUEST_PATH = (  # by the rule, not a list: any module of the diffusion tree
    "vllm_omni.diffusion.distributed.comm",
    "vllm_omni.diffusion.attention.parallel.ulysses",
    "vllm_omni.diffusion.models.minimax_h3.pipeline_minimax_h3",
    "vllm_omni.diffusion.distributed.autoencoders.wan_spatial_shard",
)
_OUTSIDE = "vllm_omni.model_executor.models.mimo_audio.quantization"  # imports torch.distributed as dist


def _torch_distributed_names() -> dict[str, int]:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    return {f"{ns.__name__}.{name}": id(getattr(ns, name)) for ns in (dist, c10d) for name in dir(ns)}


def _routed(coordinator: type) -> bool:
    """Whether the coordinator's methods are the staged ones the plugin installs."""
    from vllm_omni.distributed import request_collectives as rc

    return getattr(coordinator.all_reduce, "__wrapped__", None) is rc.coordinator_all_reduce


def _staging_now() -> bool:
    """Whether collectives stage here now: the platform's choice where the plugin gave the platform one (a worker
    that stages), else torch's own."""
    from vllm_omni.distributed import request_collectives as rc
    from vllm_omni.platforms.interface import OmniPlatform

    return "collectives" in vars(OmniPlatform) and rc.platform_collectives().staged


def _load_plugins_in_a_worker(rank: int, world: int, value: str, env: dict[str, str] | None = None) -> dict:
    """A diffusion worker's order: its module is imported, then the plugins load, then ``init_device`` runs."""
    import importlib

    os.environ.update(env or {})

    import torch

    from vllm_omni.diffusion.distributed.group_coordinator import GroupCoordinator
    from vllm_omni.diffusion.worker import diffusion_worker
    from vllm_omni.distributed import managed_distributed
    from vllm_omni.distributed import persistent_collectives as pc
    from vllm_omni.distributed import request_collectives as rc
    from vllm_omni.platforms.interface import OmniPlatform
    from vllm_omni.plugins import load_omni_general_plugins

    before = _torch_distributed_names()
    # Stand-ins for the device and process-group set-up (the gloo group is already up in this rank) and the load.
    diffusion_worker.DiffusionWorker.init_device = lambda self: ("groups up", _staging_now())
    diffusion_worker.DiffusionWorker.load_model = lambda self, **kwargs: _staging_now()
    worker_before, coordinator_before = dict(vars(diffusion_worker.DiffusionWorker)), dict(vars(GroupCoordinator))
    platform_before = dict(vars(OmniPlatform))
    os.environ.pop("VLLM_PLUGINS", None)
    os.environ[pc.SWITCH_ENV] = value
    try:
        load_omni_general_plugins()
    except ValueError as error:
        return {"error": str(error)}
    routed_before = _routed(GroupCoordinator)
    returned = diffusion_worker.DiffusionWorker.init_device(object())
    modules = [importlib.import_module(name) for name in _REQUEST_PATH]  # loaded after the hook: hooked on import
    from vllm_omni.diffusion.distributed import group_coordinator, hsdp  # imported before the hook: hooked then
    from vllm_omni.diffusion.models.minimax_h3 import vae_gather
    from vllm_omni.distributed import persistent_fsdp

    return {
        "routed_before_init_device": routed_before,
        "routed": _routed(GroupCoordinator),
        # Dynamo inlines them: compiled, a graph holds their ops (a disabled method would break it at each call)
        "coordinator_traced": not any(
            getattr(getattr(GroupCoordinator, name), "_torchdynamo_disable", False)
            for name in ("all_reduce", "all_gather", "broadcast")
        ),  # fmt: skip
        "staged": "collectives" in vars(OmniPlatform) and rc.platform_choice().staged,
        "modules_managed": [module.dist is managed_distributed for module in modules],
        "coordinator_module_managed": group_coordinator.torch.distributed is managed_distributed,
        "fully_shard_persistent": hsdp.fully_shard is persistent_fsdp.fully_shard,
        "outside_untouched": importlib.import_module(_OUTSIDE).dist is torch.distributed,
        "own_blocks_untouched": vae_gather.dist is torch.distributed,  # its gather is into its own workspace
        "torch_distributed_untouched": _torch_distributed_names() == before,
        "returned": returned,
        "loads_plain": diffusion_worker.DiffusionWorker.load_model(object()) is False,
        "worker_changed": _changed(worker_before, vars(diffusion_worker.DiffusionWorker)),
        "coordinator_changed": _changed(coordinator_before, vars(GroupCoordinator)),
        "platform_changed": _changed(platform_before, vars(OmniPlatform)),
    }


def _changed(before: dict, after) -> list[str]:
    """The attributes of a class that are not the very objects they were."""
    return sorted(name for name in before.keys() | after.keys() if before.get(name) is not after.get(name))


def _started_together(scenarios: dict[str, tuple], **env: str) -> dict[str, dict]:
    """Each scenario ``(fn, *args)`` in a fresh single-rank interpreter (spawned: the plugin reads its switches when
    vLLM-Omni loads), all started at once: each loads vLLM-Omni on its own (about ten seconds of CPU), so started
    together they take the time of a few on this machine's cores. Each test reads its own scenario's outcome
    (``results_or_raise``), so a failure names the scenario it comes from."""
    from concurrent.futures import ThreadPoolExecutor

    with pytest.MonkeyPatch.context() as mp, ThreadPoolExecutor(max_workers=len(scenarios)) as pool:
        for name, value in env.items():  # read at interpreter start: set before the processes are spawned
            mp.setenv(name, value)
        started = {
            key: pool.submit(run_ranks, fn, 1, *args, timeout_s=600, prepare=use_working_tree)
            for key, (fn, *args) in scenarios.items()
        }
        return {key: future.result() for key, future in started.items()}


def _outcome(runs: dict[str, dict], key: str) -> dict:
    (report,) = results_or_raise(runs[key], 1)
    return report


@pytest.fixture(scope="module")
def in_a_worker() -> dict[str, dict]:
    """Every diffusion-worker scenario of this module. Importing the worker module pulls in vLLM's model registry,
    which on 0.30.0 needs the CPU test platform's start-up stand-ins (torchvision does not load beside torch+cpu)."""
    cap = "VLLM_OMNI_PERSISTENT_COLLECTIVES_MAX_BLOCK_MIB"
    scenarios = {
        **{value: (_load_plugins_in_a_worker, value) for value in ("1", "auto", "0", "on")},
        "bad cap": (_load_plugins_in_a_worker, "1", {cap: "64MiB"}),
        "pool": (_pool_mode_in_a_worker, True),
        "pool without MemPool": (_pool_mode_in_a_worker, False),
        "pool expandable": (_pool_mode_in_a_worker, True, EXPANDABLE),
        "pool under its name before 0.12.2": (
            _pool_mode_in_a_worker,
            True,
            "",
            {"VLLM_OMNI_PERSISTENT_COLLECTIVES": "pool"},
        ),
    }
    return _started_together(scenarios, VLLM_OMNI_CPU_TEST_PLATFORM="1")


def test_a_staging_worker_routes_its_request_path_through_the_platform_and_stages(in_a_worker):
    report = _outcome(in_a_worker, "1")
    assert report == {
        "routed_before_init_device": False,
        "routed": True,
        "coordinator_traced": True,
        "staged": True,
        "modules_managed": [True] * len(_REQUEST_PATH),
        "coordinator_module_managed": True,  # its tensor-dict and point-to-point methods name torch.distributed
        "fully_shard_persistent": True,
        "outside_untouched": True,
        "own_blocks_untouched": True,
        "torch_distributed_untouched": True,  # not one torch.distributed or distributed_c10d name replaced
        "returned": ("groups up", False),  # start-up and model load run plain collectives
        "loads_plain": True,
        "worker_changed": ["init_device", "load_model"],
        "coordinator_changed": ["__init__", "all_gather", "all_reduce", "broadcast"],
        "platform_changed": ["collectives"],
    }


@pytest.mark.parametrize("value", ["auto", "0"])  # auto: staging on XPU only, and this is the CPU test platform
def test_a_worker_that_does_not_stage_leaves_every_class_and_module_as_released(value, in_a_worker):
    report = _outcome(in_a_worker, value)
    assert report == {
        "routed_before_init_device": False,
        "routed": False,
        "coordinator_traced": True,
        "staged": False,
        "modules_managed": [False] * len(_REQUEST_PATH),
        "coordinator_module_managed": False,
        "fully_shard_persistent": False,
        "outside_untouched": True,
        "own_blocks_untouched": True,
        "torch_distributed_untouched": True,
        "returned": ("groups up", False),
        "loads_plain": True,
        "worker_changed": [],
        "coordinator_changed": [],
        "platform_changed": [],
    }


def test_a_bad_switch_fails_the_plugin_load_naming_the_value(in_a_worker):
    report = _outcome(in_a_worker, "on")
    assert "VLLM_OMNI_PERSISTENT_COLLECTIVES='on' is not valid" in report["error"]


def test_a_bad_block_cap_fails_the_plugin_load_naming_the_value(in_a_worker):
    report = _outcome(in_a_worker, "bad cap")
    assert "VLLM_OMNI_PERSISTENT_COLLECTIVES_MAX_BLOCK_MIB='64MiB' is not valid" in report["error"]


EXPANDABLE = "garbage_collection_threshold:0.6,expandable_segments:True"


def _pool_mode_in_a_worker(rank: int, world: int, platform_has_pool: bool, alloc_conf: str = "", env=None) -> dict:
    """A diffusion worker with its request pool, its start-up, load, request entry points, sleep and wake-up stood in
    for; records whether the worker's pool was in use in each, and whether anything routes collectives."""
    import types

    import torch
    from vllm_omni_cpu_test_platform.mem_pool import MemPool

    from vllm_omni.diffusion.distributed.group_coordinator import GroupCoordinator
    from vllm_omni.diffusion.worker import diffusion_worker
    from vllm_omni.distributed import persistent_collectives as pc
    from vllm_omni.distributed import request_pool
    from vllm_omni.platforms import current_omni_platform
    from vllm_omni.plugins import load_omni_general_plugins
    from xpu_collective_memory import plugin

    seen: list[tuple[str, bool]] = []

    def record(self, name: str) -> None:
        pool = getattr(self, "request_pool", None)
        seen.append((name, pool is not None and pool.active))

    worker = diffusion_worker.DiffusionWorker

    def execute_model(self, req, fail=False):
        record(self, "execute_model")
        if fail:
            raise RuntimeError("the forward failed")
        worker.execute_stepwise(self, None)  # one entry point calling another

    worker.init_device = lambda self: seen.append(("init_device", getattr(self, "request_pool", None) is not None))
    worker.load_model = lambda self, **kwargs: record(self, "load_model")
    worker.execute_model = execute_model
    worker.execute_model_batch = lambda self, *args: record(self, "execute_model_batch")
    worker.execute_stepwise = lambda self, *args: record(self, "execute_stepwise")
    worker.sleep = lambda self, level=1: seen.append(
        ("sleep: pool released before its empty_cache", self.request_pool._pool is None)
    )
    worker.wake_up = lambda self, tags=None: True
    if not platform_has_pool:
        type(current_omni_platform).mem_pool_api = None
    os.environ.pop("VLLM_PLUGINS", None)
    os.environ.update(env or {request_pool.POOL_ENV: "1"})
    os.environ["PYTORCH_ALLOC_CONF"] = alloc_conf
    load_omni_general_plugins()
    this = types.SimpleNamespace(device=torch.device("cpu"))  # what the worker's own init_device sets
    try:
        worker.init_device(this)
    except (RuntimeError, ValueError) as error:
        return {"error": str(error)}
    worker.load_model(this)
    worker.execute_model(this, None)
    with contextlib.suppress(RuntimeError):
        worker.execute_model(this, None, fail=True)
    worker.execute_model_batch(this, None, None)
    pool, mem_pool = this.request_pool, this.request_pool._pool
    worker.sleep(this)
    made_before_wake_up = MemPool.made
    worker.wake_up(this)
    return {
        "seen": seen,
        "entries": mem_pool.entries,
        "pools_made": made_before_wake_up,
        "pool_after_wake_up": MemPool.made == made_before_wake_up + 1 and this.request_pool._pool is not mem_pool,
        "active_after": pool.active,
        "routed": plugin._request_path_hook is not None or _routed(GroupCoordinator),
        "collectives": _staging_now(),
        "switches": {name: os.environ.get(name) for name in (request_pool.POOL_ENV, pc.SWITCH_ENV)},
    }


@pytest.mark.parametrize("key", ["pool", "pool under its name before 0.12.2"])
def test_the_request_pool_is_made_after_start_up_every_request_entry_point_runs_in_it_and_sleep_drops_it(
    in_a_worker, key
):
    report = _outcome(in_a_worker, key)
    assert report == {
        "seen": [
            ("init_device", False),  # the pool is made once the device is set
            ("load_model", False),
            ("execute_model", True),
            ("execute_stepwise", True),
            ("execute_model", True),  # the one that raises: the pool is closed behind it
            ("execute_model_batch", True),
            ("sleep: pool released before its empty_cache", True),
        ],
        "entries": 3,  # the nested entry point does not enter again
        "pools_made": 1,
        "pool_after_wake_up": True,  # wake_up makes a new one
        "active_after": False,
        "routed": False,  # no module rebound, the coordinator as released
        "collectives": False,  # the platform's are torch's own, unstaged
        "switches": {"VLLM_OMNI_DIFFUSION_REQUEST_MEM_POOL": "1", "VLLM_OMNI_PERSISTENT_COLLECTIVES": None},
    }


def test_the_request_pool_on_a_platform_whose_torch_has_no_mem_pool_fails_the_workers_start_up_naming_it(
    in_a_worker,
):
    import torch

    report = _outcome(in_a_worker, "pool without MemPool")
    assert f"torch.cpu.MemPool and use_mem_pool, which torch {torch.__version__} does not have" in report["error"]


def test_the_request_pool_with_expandable_segments_fails_the_workers_start_up_naming_the_variable(
    in_a_worker,
):
    report = _outcome(in_a_worker, "pool expandable")
    assert report["error"].startswith(f"PYTORCH_ALLOC_CONF={EXPANDABLE!r} turns on expandable segments"), report
    assert "remove expandable_segments:True from PYTORCH_ALLOC_CONF" in report["error"]


_NOT_A_WORKER_PROCESS = """
import json, sys
from tests.xpu_collective_memory.test_plugin import _routed, _torch_distributed_names
before = _torch_distributed_names()
from vllm_omni.plugins import load_omni_general_plugins
load_omni_general_plugins()
from vllm_omni.diffusion.distributed.group_coordinator import GroupCoordinator
print(json.dumps({
    "untouched": _torch_distributed_names() == before,
    "coordinator_released": not _routed(GroupCoordinator),
    "worker_imported": "vllm_omni.diffusion.worker.diffusion_worker" in sys.modules,
}))
"""


def _fresh_process(code: str, **env: str) -> dict:
    """Run ``code`` in a new interpreter without this project's switches (but ``env``); its last line, as JSON."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_OMNI_", "VLLM_PLUGINS"))}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=clean | env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_loading_the_plugins_outside_a_diffusion_worker_leaves_the_coordinator_as_released():
    # An API server or an LLM stage loads the same plugins; with the switch forced on, it still hooks nothing.
    report = _fresh_process(_NOT_A_WORKER_PROCESS, VLLM_OMNI_PERSISTENT_COLLECTIVES="1")
    assert report == {"untouched": True, "coordinator_released": True, "worker_imported": False}


def test_vllm_plugins_without_ours_leaves_the_adapter_untouched(loaded):
    report = _outcome(loaded, "without ours")
    assert not report["hooked"]
    assert not report["forced_installed"] and report["forced_untouched"]


def test_vllm_plugins_with_the_old_name_hooks_the_adapter_and_warns_naming_the_new_one(loaded):
    report = _outcome(loaded, "old name")
    assert report["hooked"] and report["wrapped_once"] and report["forced_installed"]
    renamed, _, hooked = report["messages"]
    assert "VLLM_PLUGINS names 'minimax_h3_vae_gather', renamed 'xpu_collective_memory'" in renamed
    assert "VLLM_PLUGINS=xpu_collective_memory" in renamed
    assert "hooked vllm_omni.diffusion.models.minimax_h3.vae.MiniMaxH3VideoVAE.__init__" in hooked


@pytest.mark.parametrize(
    "replacement",
    [
        pytest.param(None, id="adapter-missing"),
        pytest.param(type("MiniMaxH3VideoVAE", (), {"__init__": lambda self, component_path: None}), id="other-shape"),
    ],
)
def test_unexpected_adapter_warns_once_and_patches_nothing(monkeypatch, replacement):
    from vllm_omni.diffusion.models.minimax_h3 import vae

    if replacement is None:
        monkeypatch.delattr(vae, "MiniMaxH3VideoVAE")
    else:
        monkeypatch.setattr(vae, "MiniMaxH3VideoVAE", replacement)
        original_init = replacement.__init__
    monkeypatch.setattr(plugin, "_warned", False)
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger(plugin.logger.name).addHandler(handler)
    try:
        plugin.register()
        plugin.register()
    finally:
        logging.getLogger(plugin.logger.name).removeHandler(handler)
    assert len(warnings) == 1 and "MiniMax-H3's VAE keeps the checkpoint's tile gather" in warnings[0]
    if replacement is not None:
        assert replacement.__init__ is original_init
        assert "another shape" in warnings[0]


_OTHER_MODEL_PROCESS = """
import json, sys
from vllm_omni.plugins import load_omni_general_plugins
load_omni_general_plugins()
loaded = sorted(m for m in sys.modules if ".minimax_h3" in m)
from vllm_omni.diffusion.models.minimax_h3.vae import MiniMaxH3VideoVAE
print(json.dumps({"loaded": loaded, "hooked": getattr(MiniMaxH3VideoVAE.__init__, "_minimax_h3_tile_gather_hook", 0)}))
"""


def test_loading_the_plugins_imports_no_minimax_h3_module_and_the_first_import_hooks_the_adapter():
    assert _fresh_process(_OTHER_MODEL_PROCESS) == {"loaded": [], "hooked": True}


def test_a_failure_inside_the_hook_is_logged_and_never_reaches_the_import(monkeypatch, caplog):
    from vllm_omni.diffusion.models.minimax_h3 import vae

    def broken(module):
        raise RuntimeError("injected: the hook failed")

    monkeypatch.setattr(plugin, "_adapter_class", broken)
    plugin._hook_quietly(vae)
    assert any("could not hook" in r.getMessage() and r.exc_info for r in caplog.records)


def _fake_dist(root, name: str, version: str, content: bytes | None) -> PathDistribution:
    """A distribution whose RECORD lists the overlay file with the hash of ``content`` (None: not listed)."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = [f"{info.name}/METADATA,,"]
    if content is not None:
        digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
        lines.append(f"{overlay.OVERLAY_FILE},sha256={digest},{len(content)}")
    (info / "RECORD").write_text("\n".join(lines) + "\n")
    return PathDistribution(info)


@pytest.mark.parametrize(
    "omni_ships,expected",
    [
        (False, None),
        (
            True,
            "vllm-omni 9.9.0 ships its own vllm_omni/diffusion/models/minimax_h3/vae_gather.py, as does "
            "vllm-omni-xpu-collective-memory 0.3.0; the file on disk is vllm-omni-xpu-collective-memory 0.3.0's. "
            "Reinstall the one you mean to run last",
        ),
    ],
    ids=["release-without-the-file", "release-with-its-own-file"],
)
def test_a_release_that_ships_its_own_vae_gather_is_named_with_both_versions(
    monkeypatch, tmp_path, omni_ships, expected
):
    ours = b"# ours\n"
    target = tmp_path / overlay.OVERLAY_FILE
    target.parent.mkdir(parents=True)
    target.write_bytes(ours)  # pip installed ours last
    dists = {
        "vllm-omni": _fake_dist(tmp_path, "vllm-omni", "9.9.0", b"# upstream's\n" if omni_ships else None),
        overlay.PROJECT_DIST: _fake_dist(tmp_path, overlay.PROJECT_DIST, "0.3.0", ours),
    }
    monkeypatch.setattr(overlay, "distribution", dists.__getitem__)
    assert overlay.overlay_conflict() == expected
