# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
from tests.distributed import ranks
from tests.utils import use_working_tree

# Before any test module imports vae_gather: the checkout under test, never a stale installed copy; in every
# spawned rank too.
use_working_tree()
ranks.PREPARE = use_working_tree
