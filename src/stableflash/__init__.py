"""stableflash: stable low-precision flash attention, and the instruments that show why BF16
flash-attention training fails (arXiv 2510.04212)."""
from stableflash import numerics
from stableflash.attention import (PrecisionPolicy, ShiftRule, Stabilization, flash_attention, flash_attn_func,
                                   flash_attn_qkvpacked_func, flash_attn_varlen_func)

__version__ = "0.1.0"
__all__ = ["flash_attention", "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "Stabilization", "PrecisionPolicy", "ShiftRule", "numerics", "__version__"]
