# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Remote code of the synthetic MiniMax-H3 video VAE checkpoint, copied into the component directory."""
