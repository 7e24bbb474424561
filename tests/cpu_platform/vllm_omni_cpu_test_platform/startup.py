# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Imported at every interpreter start (``vllm_omni_cpu_test_platform.pth``); does nothing unless the platform
is requested. Then it stands in for two imports that fail on this CPU stack before any plugin can run:

- ``torchaudio``: vLLM-Omni's API server imports it at module level (``entrypoints/openai/audio_utils_mixin.py``,
  ``utils/audio.py``), and PyPI has no torchaudio for torch 2.13.0+cpu. Text-to-video+audio output never calls
  it, so the stand-in imports and raises the moment anything is called.
- ``transformers.models.qwen2_vl.image_processing_qwen2_vl``: vLLM 0.30's ``qwen2_vl.py`` imports ``smart_resize``
  from it at module level and it needs torchvision, which does not load beside torch+cpu; its PIL twin serves.

Each is served only when the real module cannot be found and torch sees no accelerator.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

_QWEN2_VL = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


class Unavailable(types.ModuleType):
    """A module whose every attribute is a function that raises when called: for a package with no CPU build here."""

    __version__ = "0+cpu-test-stand-in"

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(
                f"{self.__name__}.{name} was called, but {self.__name__.partition('.')[0]} is a test stand-in here "
                "(no build of it loads beside torch 2.13.0+cpu); the CPU test platform does not support this request"
            )

        return unavailable


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        wanted = fullname == "torchaudio" or fullname.startswith("torchaudio.") or fullname == _QWEN2_VL
        if not wanted or self._real_exists(fullname):
            return None
        import torch

        if torch.accelerator.is_available():
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname == "torchaudio")

    def _real_exists(self, fullname: str) -> bool:
        if fullname == _QWEN2_VL:
            return importlib.util.find_spec("torchvision") is not None
        top = fullname.partition(".")[0]
        return any(
            finder is not self and hasattr(finder, "find_spec") and finder.find_spec(top, None) is not None
            for finder in sys.meta_path
        )

    def create_module(self, spec):
        return Unavailable(spec.name) if spec.name.startswith("torchaudio") else None

    def exec_module(self, module) -> None:
        if module.__name__ == "torchaudio":
            module.__path__ = []
            for name in ("functional", "transforms"):  # as the real package, which imports them itself
                setattr(module, name, importlib.import_module(f"torchaudio.{name}"))
            return
        if module.__name__ == _QWEN2_VL:
            from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

            module.smart_resize = pil.smart_resize
            module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
            module.Qwen2VLImageProcessorKwargs = pil.Qwen2VLImageProcessorKwargs


if os.environ.get("VLLM_OMNI_CPU_TEST_PLATFORM", "").strip() == "1" and not any(
    isinstance(f, _StandIns) for f in sys.meta_path
):
    sys.meta_path.insert(0, _StandIns())
