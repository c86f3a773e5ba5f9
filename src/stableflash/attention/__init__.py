"""Attention backends behind one entry point, ``flash_attention``, and SDPA-compatible wrappers."""
from stableflash.attention.api import BACKENDS, flash_attention
from stableflash.attention.flash_style import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from stableflash.attention.dropin import StableAttention, scaled_dot_product_attention
from stableflash.attention.policy import PRESETS, PrecisionPolicy, resolve_policy
from stableflash.attention.shift import RULES, ShiftRule
from stableflash.attention.stabilization import Stabilization

__all__ = ["flash_attention", "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "scaled_dot_product_attention", "StableAttention", "BACKENDS", "PrecisionPolicy",
           "PRESETS", "resolve_policy", "ShiftRule", "RULES", "Stabilization"]
