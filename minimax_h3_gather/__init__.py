# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What an operator installs beside the fix: the plugin for released vLLM-Omni and the collective census."""
