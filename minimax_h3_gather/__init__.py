# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What stays out of tree: the plugin for released vLLM-Omni, the collective ledger, the synthetic checkpoint."""
