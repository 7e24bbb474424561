#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
#
# Create or refresh a virtual environment for one CPU stack, then install this project into it.
#   scripts/setup_env.sh            -> .venv           (requirements/cpu.txt: vllm-omni 0.28.0)
#   scripts/setup_env.sh omni-0.30  -> .venv-omni-0.30 (requirements/cpu-omni-0.30.txt)
# Idempotent: when neither the requirements nor the project's sources changed, it returns in a second.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

case "${1:-default}" in
  default) venv=.venv; reqs=requirements/cpu.txt ;;
  omni-0.30) venv=.venv-omni-0.30; reqs=requirements/cpu-omni-0.30.txt ;;
  *) echo "setup_env.sh: unknown stack '${1}', expected 'default' or 'omni-0.30'" >&2; exit 2 ;;
esac

python=${PYTHON:-python3.11}
if ! command -v "$python" >/dev/null 2>&1; then
  python=python3
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "setup_env.sh: Python 3.11 is required, '$python' is $("$python" --version 2>&1)" >&2
  exit 2
fi

# Stamps decide what to redo: the requirements (minutes), then the project itself (seconds).
reqs_stamp=$(cat "$reqs" requirements/common.txt requirements/bench.txt requirements/test.txt | sha256sum | cut -d' ' -f1)
project_stamp=$(cat setup.py pyproject.toml README.md \
  $(find vllm_omni xpu_collective_memory tests/cpu_platform tests/distributed/mem_pool_stand_in.py -not -path '*/build/*' \
    \( -name '*.py' -o -name '*.toml' -o -name '*.pth' \) | LC_ALL=C sort) \
  | sha256sum | cut -d' ' -f1)
stamp_of() { cat "$venv/.stamp-$1" 2>/dev/null || true; }
if [ "$(stamp_of requirements)" = "$reqs_stamp" ] && [ "$(stamp_of project)" = "$project_stamp" ]; then
  exit 0
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
if [ "$(stamp_of requirements)" != "$reqs_stamp" ]; then
  echo "setup_env.sh: installing $reqs into $venv (a few minutes the first time)" >&2
  "${pip[@]}" install -q -r "$reqs" -r requirements/test.txt
  # PyPI's torchvision, torchaudio and torchcodec come in as dependencies of vllm/vllm-omni but are built
  # against the CUDA torch: beside torch+cpu they fail at import (missing torchvision::nms, _torchaudio.so,
  # libtorchcodec_image.so) and take vllm-omni's imports down with them. The MiniMax-H3 video VAE needs none.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$reqs_stamp" > "$venv/.stamp-requirements"
fi

# Our modules land inside the installed vllm-omni package, and the plugin entry point is registered. The
# distribution's name before 0.12.0 goes first: its plugin would hook the workers a second time. Both stacks build
# from this checkout's build/ and *.egg-info: one build at a time (scripts/test.sh sets both up at once).
exec 9<setup.py
flock 9
"${pip[@]}" uninstall -q -y minimax-h3-vae-gather 2>/dev/null || true
# setuptools never empties build/: a package renamed or removed since the last build would ship again.
rm -rf build
"${pip[@]}" install -q --no-deps --force-reinstall .
# Test-only: the CPU platform for vLLM-Omni (tests/cpu_platform), which the product never installs. It stays
# inert unless VLLM_OMNI_CPU_TEST_PLATFORM=1 on a machine without an accelerator.
"${pip[@]}" install -q --no-deps --force-reinstall ./tests/cpu_platform
echo "$project_stamp" > "$venv/.stamp-project"
flock -u 9
echo "setup_env.sh: $venv ready" >&2
