# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""This checkout's own: the tests of ``tests/distributed`` run in the pristine 0.30.0 tree with their patch, not here.

These files go upstream whole, each in the patch that owns it, and ``tooling.upstream_patches`` runs each in the
0.30.0 tree with its patch and the ones before it (``tests/patches``), under the same torch as this checkout's
stacks. On a released vLLM-Omni the plugin routes the coordinator and the request path's modules; the census and
the plugin's tests serve those releases with it.
"""

import os

from tooling.upstream_patches import TREE_ENV

if os.environ.get(TREE_ENV) is None:  # not a patched tree: a release this checkout's stack installs
    collect_ignore_glob = ["test_*.py"]
