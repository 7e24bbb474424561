# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What an operator installs beside the fix at upstream's paths: the plugin that applies it to a released vLLM-Omni
in diffusion workers, the reach check of every collective call site, and the collective census."""
