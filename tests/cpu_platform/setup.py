# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Ships ``vllm_omni_cpu_test_platform.pth`` beside the package (it installs the start-up import stand-ins), and
the stand-in for ``torch.xpu``'s pool API that the pool-mode tests use (one file, ``tests/distributed``'s) as
``vllm_omni_cpu_test_platform.mem_pool``, so that served workers on CPU ranks use it too."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "vllm_omni_cpu_test_platform.pth"
MEM_POOL = Path(__file__).parent.parent / "distributed" / "mem_pool_stand_in.py"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).with_name(PTH)), str(Path(self.build_lib) / PTH))
        self.copy_file(str(MEM_POOL), str(Path(self.build_lib) / "vllm_omni_cpu_test_platform" / "mem_pool.py"))


setup(cmdclass={"build_py": BuildWithPth})
