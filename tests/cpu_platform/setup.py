# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Ships ``vllm_omni_cpu_test_platform.pth`` beside the package: it installs the start-up import stand-ins."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "vllm_omni_cpu_test_platform.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).with_name(PTH)), str(Path(self.build_lib) / PTH))


setup(cmdclass={"build_py": BuildWithPth})
