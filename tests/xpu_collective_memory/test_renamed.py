# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The names operators set in an earlier release keep working for one more, with a warning that names the new one."""

from __future__ import annotations

import logging

import pytest

from xpu_collective_memory import census, renamed

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


@pytest.fixture
def warnings(monkeypatch):
    monkeypatch.setattr(renamed, "_warned", set())
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger(renamed.logger.name).addHandler(handler)
    yield seen
    logging.getLogger(renamed.logger.name).removeHandler(handler)


@pytest.mark.parametrize(
    ("plugins", "registers", "suggested"),
    [
        (None, False, None),  # vLLM-Omni loads every entry point: the new name registers
        ("xpu_collective_memory", False, None),  # the old entry point is not even loaded then
        ("minimax_h3_vae_gather", True, "VLLM_PLUGINS=xpu_collective_memory"),
        ("cpu_test,minimax_h3_vae_gather", True, "VLLM_PLUGINS=cpu_test,xpu_collective_memory"),
        ("minimax_h3_vae_gather,xpu_collective_memory", False, "VLLM_PLUGINS=xpu_collective_memory"),
        # vLLM's loader strips nothing: " xpu_collective_memory" loads nothing, so the old name must register
        ("minimax_h3_vae_gather, xpu_collective_memory", True, "VLLM_PLUGINS=xpu_collective_memory"),
    ],
)
def test_the_old_plugin_name_registers_only_where_vllm_plugins_picks_it_alone_and_names_the_new_one(
    monkeypatch, warnings, plugins, registers, suggested
):
    if plugins is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", plugins)
    calls = []
    renamed.old_entry_point("minimax_h3_vae_gather", lambda: calls.append(1))()
    assert calls == ([1] if registers else [])
    if suggested is None:
        assert warnings == []
    else:
        (line,) = warnings
        assert "'minimax_h3_vae_gather', renamed 'xpu_collective_memory' in 0.12.0" in line and line.endswith(suggested)


def test_loaded_twice_in_one_process_the_old_name_warns_once_and_registers_each_time(monkeypatch, warnings):
    monkeypatch.setenv("VLLM_PLUGINS", "minimax_h3_vae_gather")
    calls = []
    load = renamed.old_entry_point("minimax_h3_vae_gather", lambda: calls.append(1))
    load()
    load()
    assert calls == [1, 1] and len(warnings) == 1  # registering is idempotent; the warning is said once


def test_the_old_census_variable_still_names_the_directory_with_a_warning(monkeypatch, warnings, tmp_path):
    monkeypatch.delenv(census.CENSUS_ENV, raising=False)
    monkeypatch.setenv(renamed.CENSUS_ENV_BEFORE_0_12, str(tmp_path))
    assert census.census_dir() == tmp_path
    (line,) = warnings
    assert "VLLM_OMNI_H3_CENSUS_DIR is renamed VLLM_OMNI_COLLECTIVE_CENSUS_DIR" in line


def test_a_bad_old_census_variable_is_refused_under_its_own_name(monkeypatch, tmp_path):
    monkeypatch.delenv(census.CENSUS_ENV, raising=False)
    monkeypatch.setenv(renamed.CENSUS_ENV_BEFORE_0_12, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="VLLM_OMNI_H3_CENSUS_DIR='.*missing' is not an existing directory"):
        census.census_dir()


def test_both_census_variables_set_differently_are_refused_naming_both(monkeypatch, tmp_path):
    monkeypatch.setenv(census.CENSUS_ENV, str(tmp_path))
    monkeypatch.setenv(renamed.CENSUS_ENV_BEFORE_0_12, str(tmp_path / "other"))
    with pytest.raises(ValueError, match="VLLM_OMNI_COLLECTIVE_CENSUS_DIR=.* and VLLM_OMNI_H3_CENSUS_DIR=.* disagree"):
        census.census_dir()
    monkeypatch.setenv(renamed.CENSUS_ENV_BEFORE_0_12, str(tmp_path))
    assert census.census_dir() == tmp_path


def test_with_neither_census_variable_there_is_no_census(monkeypatch):
    monkeypatch.delenv(census.CENSUS_ENV, raising=False)
    monkeypatch.delenv(renamed.CENSUS_ENV_BEFORE_0_12, raising=False)
    assert census.census_dir() is None


SWITCH, POOL = "VLLM_OMNI_PERSISTENT_COLLECTIVES", "VLLM_OMNI_DIFFUSION_REQUEST_MEM_POOL"


@pytest.mark.parametrize("old", ["pool", " Pool "])
def test_the_old_pool_value_of_the_switch_turns_the_request_pool_on_and_unsets_the_switch_once_warned(warnings, old):
    environ = {SWITCH: old}
    renamed.old_pool_switch(environ)
    renamed.old_pool_switch(environ)  # loaded again in one process: nothing more to do, no second warning
    assert environ == {POOL: "1"}
    (warning,) = warnings
    assert f"{SWITCH}=pool is {POOL}=1 since 0.12.2" in warning and "stops working in 0.14.0" in warning


@pytest.mark.parametrize("environ", [{}, {SWITCH: "1"}, {SWITCH: "auto", POOL: "1"}])
def test_any_other_setting_is_left_as_it_is(warnings, environ):
    before = dict(environ)
    renamed.old_pool_switch(environ)
    assert environ == before and warnings == []


def test_the_old_pool_value_with_the_pool_turned_off_is_refused_naming_both():
    with pytest.raises(ValueError, match=rf"{SWITCH}='pool' \(the request pool, before 0.12.2\) and {POOL}='0'"):
        renamed.old_pool_switch({SWITCH: "pool", POOL: "0"})
