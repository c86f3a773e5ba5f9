"""The row-maximum rule: which value m each softmax row subtracts before exponentiating.

Flash attention computes P̄ = exp(S − m) block by block with a running maximum m and rescales
what it has accumulated whenever m grows. Softmax is shift-invariant, so any m gives the same
attention in real arithmetic; the choice only changes the rounding. Three rules live here, and
every backend calls `next_shift`, so they all apply the same arithmetic:

``standard``
    m = running max of S: the largest entry of each row gets P̄ = 1 exactly. With several equal
    maxima, several P̄ = 1 terms enter P̄V, which is what makes its low-precision rounding biased
    (the paper's Section 3.3).

``paper``
    Algorithm 3 of the paper, per key block: rm = rowmax(S), rs = #{j : rm − S_j ≤ ε} (computed as
    S_j ≥ rm − ε, one subtraction per row instead of one per entry, in every backend). Where rs > 1,
    m = β·rm if rm > 0 and m = 0 if rm < 0; otherwise m = rm. It leaves three cases open: rm = 0
    exactly (m = 0, so P̄ = 1 still), |rm| so small that exp((1 − β)·rm) rounds back to 1 in the
    low-precision format, and large |rm|, where exp(−(β − 1)·rm) (or exp(rm) for rm < 0)
    underflows, ℓ becomes 0 and O = 0/0 = NaN (the authors advise lowering β by hand). It also
    misses maxima that are equal but fall in different key blocks.

``tie-shift``
    Same detection, plus a tie between this block's maximum and the maximum of earlier blocks.
    Where a tie is found, m = rm + d with d = (β − 1)·|rm| folded into [min_shift, max_shift],
    for any sign of rm including 0:

    - d < min_shift = ln(8/7) is raised to min_shift, so the tied entries get P̄ = 7/8: below 1
      in every format with ≥ 2 mantissa bits, and exactly representable there, so the rounding
      of P̄ itself adds no scale bias (what a fixed offset of another size would do);
    - d > max_shift = ln(8/7) + 12·ln 2 is folded back into (max_shift − ln 2, max_shift] by
      subtracting its excess modulo ln 2, so P̄ = exp(−d) stays a normal number (≥ 7/8·2⁻¹²) in
      bf16, fp16 and fp32, ℓ ≥ P̄ can never underflow, and P̄ still varies with rm instead of
      sitting on one constant.

    Between the clamps it is the paper's rule for rm > 0 (m = β·rm), and for rm < 0 with β = 2.

``all-shift``
    The tie-shift's bounded shift without the tie test: every block applies m = rm + d with the same folded d. No
    P̄ is ever 1, and because d is bounded, the unconditional shift cannot underflow ℓ (the reason
    the paper gives for shifting only tied rows). It costs nothing per score — the tie count is
    the only per-entry work the other stabilized rules add to a fused kernel — at the price of
    rounding the largest P̄ of every row (unbiased, since d varies with rm).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import torch

RULES = ("standard", "paper", "tie-shift", "all-shift")
# the rules' earlier names, still read from stored run folders and result files
LEGACY_RULES = {"ours": "tie-shift", "bounded": "all-shift"}
BOUNDED_RULES = ("tie-shift", "all-shift")      # the rules whose shift is folded into [min_shift, max_shift]

LN_2 = math.log(2.0)
LN_8_7 = math.log(8.0 / 7.0)
DEFAULT_MIN_SHIFT = LN_8_7
DEFAULT_MAX_SHIFT = LN_8_7 + 12.0 * math.log(2.0)


def finite(value) -> bool:
    """math.isfinite for a real number, written with comparisons, which torch.compile traces for a
    symbolic float too (under dynamic=True a float argument is one; math.isfinite would break the
    graph)."""
    return value == value and -math.inf < value < math.inf


def _real(value) -> bool:
    """A real number of any type (NumPy scalars included), bool excepted."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class ShiftRule:
    """A row-maximum rule: ``kind`` in ``RULES`` and its parameters (validated on creation)."""

    kind: str = "standard"
    beta: float = 2.0
    eps: float = 1e-3
    min_shift: float = DEFAULT_MIN_SHIFT
    max_shift: float = DEFAULT_MAX_SHIFT

    def __post_init__(self) -> None:
        if self.kind not in RULES:
            renamed = f" ({self.kind!r} is the earlier name of {LEGACY_RULES[self.kind]!r})" if self.kind in LEGACY_RULES else ""
            raise ValueError(f"ShiftRule kind={self.kind!r} is not a rule{renamed}; accepted: {', '.join(RULES)}")
        if not (_real(self.beta) and finite(self.beta) and self.beta > 1):
            raise ValueError(f"beta={self.beta!r} is invalid; accepted: a finite number > 1 (the paper uses 2 to 8)")
        if not (_real(self.eps) and finite(self.eps) and self.eps >= 0):
            raise ValueError(f"eps={self.eps!r} is invalid; accepted: a finite number >= 0 (the paper uses 1e-3)")
        if not (0 < self.min_shift <= self.max_shift and finite(self.max_shift)):
            raise ValueError(
                f"min_shift={self.min_shift!r}, max_shift={self.max_shift!r} are invalid; "
                "accepted: 0 < min_shift <= max_shift < inf")
        for name in ("beta", "eps", "min_shift", "max_shift"):    # valid: each a plain float (NumPy scalars, ints)
            value = getattr(self, name)
            if _real(value) and type(value) is not float:
                object.__setattr__(self, name, float(value))

    @property
    def stabilized(self) -> bool:
        return self.kind != "standard"

    def capped_for(self, min_normal: float) -> "ShiftRule":
        """This rule with max_shift lowered so that exp(−max_shift) stays ≥ ``min_normal``.

        For formats with a narrow exponent range (fp8 e4m3: min normal 2⁻⁶) the default cap would
        push the tied entries' P̄ into the subnormals. Only "tie-shift" and "all-shift" fold their shift
        into [min_shift, max_shift]; any other rule comes back unchanged. Every backend applies it
        with P̄'s format.
        """
        if self.kind not in BOUNDED_RULES:
            return self
        k = max(0, math.floor(math.log2(7.0 / (8.0 * min_normal))))  # 7/8·2⁻ᵏ ≥ min_normal
        cap = LN_8_7 + k * math.log(2.0)
        if cap >= self.max_shift:
            return self
        return replace(self, max_shift=max(cap, self.min_shift))


def next_shift(s: torch.Tensor, m_prev: torch.Tensor, r_prev: torch.Tensor,
               rule: ShiftRule) -> tuple[torch.Tensor, torch.Tensor]:
    """One key block's update of the running shift.

    s: scores of the block, shape (..., rows, cols), masked entries −inf.
    m_prev: the shift used so far, (..., rows); −inf before the first block.
    r_prev: the true running maximum of S so far, (..., rows); −inf before the first block.
    Returns (m_new, r_new); m_new ≥ m_prev and m_new ≥ max(s) always.
    """
    rm = s.amax(dim=-1)
    r_new = torch.maximum(r_prev, rm)
    m = rm
    if rule.kind != "standard":
        valid = torch.isfinite(rm)                                        # fully masked rows: no max
        ties = valid & ((s >= (rm - rule.eps).unsqueeze(-1)).sum(dim=-1) > 1)  # rs = #{j: rm − S_j ≤ ε}
        if rule.kind == "paper":
            m = torch.where(ties & (rm > 0), rule.beta * rm, m)
            m = torch.where(ties & (rm < 0), torch.zeros_like(rm), m)
        else:
            if rule.kind == "tie-shift":
                ties = ties | (valid & torch.isfinite(r_prev) & ((rm - r_prev).abs() <= rule.eps))
            else:                                                         # all-shift: every row
                ties = valid
            d = _fold((rule.beta - 1.0) * rm.abs(), rule.min_shift, rule.max_shift)
            m = torch.where(ties, rm + d, m)
    return torch.maximum(m_prev, m), r_new


def bound_rounded_shift(m_new: torch.Tensor, m_prev: torch.Tensor, r_new: torch.Tensor, rule: ShiftRule,
                        limit: float) -> torch.Tensor:
    """The shift after it was rounded up into a narrow score format (the paper's emulation keeps S
    and m in bf16), kept from underflowing the row.

    Rounding up can move m far past rm + max_shift where the format is coarse: at |rm| ≥ 2¹³ a bf16
    step is ≥ 64, and at 16 512 the only bf16 value above rm is rm + 128, which puts every P̄ of the
    row at exp(−128) = 0: ℓ = 0 and O = 0/0 (seen in training once the attention logits had grown
    that large). Where the rounded shift exceeds ``limit`` (the largest shift at which the row
    maximum's P̄ is still a normal number of the P̄ format: 87.3 for bf16), the rules "tie-shift" and
    "all-shift" fall back to the standard shift max(m_prev, r_new), which the format holds exactly.
    Overshoots below ``limit`` (a bf16 step at ordinary logits) are harmless and kept. "paper" is
    left as the authors wrote it.
    """
    if rule.kind not in BOUNDED_RULES:
        return m_new
    return torch.where(m_new - r_new > limit, torch.maximum(m_prev, r_new), m_new)


def _fold(d: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """d raised to ``lo`` from below, and above ``hi`` folded into (hi − ln 2, hi]."""
    excess = torch.remainder(d - hi, LN_2)
    return torch.where(d > hi, hi - excess, d).clamp_min(lo)


def row_shift(s: torch.Tensor, rule: ShiftRule) -> torch.Tensor:
    """The shift of each row when all its keys form one block (block size = sequence length)."""
    init = torch.full(s.shape[:-1], -math.inf, dtype=s.dtype, device=s.device)
    return next_shift(s, init, init, rule)[0]
