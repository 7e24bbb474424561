# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""SDPA for the CPU test platform: vLLM-Omni's attention dispatch raises for any platform it does not know
(``diffusion/attention/backends/abstract.py``), so the impl takes SDPA's device-independent path, the one
CUDA uses."""

from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl


class CpuSDPAImpl(SDPAImpl):
    def forward(self, query, key, value, attn_metadata=None):
        return self.forward_cuda(query, key, value, attn_metadata)


class CpuSDPABackend(SDPABackend):
    @staticmethod
    def get_impl_cls():
        return CpuSDPAImpl
