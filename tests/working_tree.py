# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Imported first by the server the test ranks fork from (``ranks.PRELOAD``, set in ``tests/conftest.py``): every rank
then has the code under test, this checkout's or a patched tree's, before an installed copy's."""

from tests.utils import use_working_tree

use_working_tree()
