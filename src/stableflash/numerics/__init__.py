"""Bit-level low-precision floating point: formats, rounding, and the trace of one addition."""
from stableflash.numerics.formats import FloatFormat, get_format, FORMAT_NAMES
from stableflash.numerics.rounding import ROUNDING_MODES, round_to, ulp, encode, decode
from stableflash.numerics.explain import AddTrace, explain_add

__all__ = [
    "FloatFormat", "get_format", "FORMAT_NAMES",
    "ROUNDING_MODES", "round_to", "ulp", "encode", "decode",
    "AddTrace", "explain_add",
]
