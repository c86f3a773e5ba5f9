"""Fused Triton kernels: FlashAttention-2 forward and backward with the stabilized row maximum.

Import this package only through ``stableflash.attention.api`` (it imports Triton), or directly
when Triton is installed. Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (slowly);
otherwise they need CUDA tensors.
"""
from stableflash.attention.triton.launch import SUPPORT, check_inputs, triton_attention

__all__ = ["triton_attention", "check_inputs", "SUPPORT"]
