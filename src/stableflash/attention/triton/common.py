"""Triton helpers shared by the kernels: the row-maximum rule (``attention/shift.py``), bf16
rounding, and the matrix product.

The kernels keep scores in log2 units (S·log2 e, so that exp becomes exp2). The rules are linear
in S, so the same code serves both unit systems: the launcher passes ε, the shift bounds and the
fold period in the units the kernel works in (period ln 2 in natural units is 1 in log2 units).
"""
import triton
import triton.language as tl

from stableflash.attention.triton.config import HP_HEAD_LIMIT, DeltaSource, Format, RuleKind

# the kernels' names for the values of the configuration's enums (config.py), which the launcher
# passes as compile-time switches: STAB (RuleKind), FMT and PFMT (Format), DELTA_SRC (DeltaSource)
STANDARD = tl.constexpr(RuleKind.STANDARD.value)
PAPER = tl.constexpr(RuleKind.PAPER.value)
TIE_SHIFT = tl.constexpr(RuleKind.TIE_SHIFT.value)
ALL_SHIFT = tl.constexpr(RuleKind.ALL_SHIFT.value)
BF16 = tl.constexpr(Format.BF16.value)
FP32 = tl.constexpr(Format.FP32.value)
FP16 = tl.constexpr(Format.FP16.value)
E5M2 = tl.constexpr(Format.FP8_E5M2.value)
E4M3 = tl.constexpr(Format.FP8_E4M3.value)
NO_FORMAT = tl.constexpr(-1)   # PFMT: P̄ has no format of its own (rounded to V's dtype, or in fp32 with PBAR32)
DELTA_DO_O = tl.constexpr(DeltaSource.DO_O.value)
DELTA_DP_P = tl.constexpr(DeltaSource.DP_P.value)
DELTA_RECOMPUTE = tl.constexpr(DeltaSource.RECOMPUTE_FP32.value)
DELTA_O_FP32 = tl.constexpr(DeltaSource.DO_O_FP32.value)
DELTA_O32 = tl.constexpr(DeltaSource.DO_O32.value)
DELTA_O16 = tl.constexpr(DeltaSource.DO_O16.value)
DELTA_O_R = tl.constexpr(DeltaSource.DO_O_R.value)
DELTA_O16_R = tl.constexpr(DeltaSource.DO_O16_R.value)
HP_LIMIT = tl.constexpr(HP_HEAD_LIMIT)   # the highest head the forward's hp_mask holds


@triton.jit
def count_ties(s, threshold):
    """Per row, how many entries of the block are ≥ threshold (a float count: fewer instructions
    than an integer one in the generated code)."""
    return tl.sum(tl.where(s >= threshold[:, None], 1.0, 0.0), 1)


@triton.jit
def shift_from_ties(rm, ties, m_prev, r_prev, STAB: tl.constexpr, beta, eps, lo, hi, period):
    """The rule itself, given the block maximum rm and its tie count (shapes (BLOCK_M,)).

    Returns (m_new, r_new): the running shift and the running maximum after this block.
    """
    r_new = tl.maximum(r_prev, rm)
    if STAB == STANDARD:
        m = rm
    else:
        tied = (ties > 1.5) & (rm > float("-inf"))        # a fully masked row has no maximum
        if STAB == PAPER:
            m = tl.where(tied & (rm > 0), beta * rm, rm)
            m = tl.where(tied & (rm < 0), 0.0, m)
        else:
            if STAB == TIE_SHIFT:
                tied = tied | (tl.abs(rm - r_prev) <= eps)      # equal to an earlier block's max
            else:                                               # ALL_SHIFT: every row, no count
                tied = rm > float("-inf")
            d = (beta - 1.0) * tl.abs(rm)
            excess = d - hi
            folded = hi - (excess - tl.floor(excess * (1.0 / period)) * period)   # 1/period: once per program
            d = tl.maximum(tl.where(d > hi, folded, d), lo)
            m = tl.where(tied, rm + d, rm)
    return tl.maximum(m_prev, m), r_new


@triton.jit
def next_shift(s, m_prev, r_prev, STAB: tl.constexpr, beta, eps, lo, hi, period):
    """One key block's update of the running shift m and running maximum r (shapes (BLOCK_M,)).

    s: (BLOCK_M, BLOCK_N) scores, −inf where masked. STAB: STANDARD, PAPER (Algorithm 3), TIE_SHIFT
    or ALL_SHIFT (the tie-shift's bounded shift on every row: no per-entry tie count).
    """
    rm = tl.max(s, 1)
    ties = rm * 0.0
    if STAB == PAPER or STAB == TIE_SHIFT:
        ties = count_ties(s, rm - eps)
    return shift_from_ties(rm, ties, m_prev, r_prev, STAB, beta, eps, lo, hi, period)


@triton.jit
def round_up_bf16(x):
    """x (fp32) rounded toward +inf to the nearest bfloat16 value, returned as fp32."""
    bits = x.to(tl.int32, bitcast=True)
    down = (bits & -65536).to(tl.float32, bitcast=True)      # toward zero: drop the low 16 bits
    up = ((bits & -65536) + 65536).to(tl.float32, bitcast=True)
    return tl.where(down < x, up, down)


@triton.jit
def cast(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """x (fp32) rounded to nearest-even in ``dtype``. The CPU interpreter truncates fp32 → bf16
    instead of rounding; INTERP rounds the bits first, so the interpreter computes what the GPU does."""
    if INTERP and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def to_bf16(x, INTERP: tl.constexpr):
    """x (fp32) rounded to nearest-even bfloat16, returned as fp32."""
    return cast(x, tl.bfloat16, INTERP).to(tl.float32)


@triton.jit
def round_mantissa(x, MBITS: tl.constexpr, INTERP: tl.constexpr):
    """x (fp32) rounded to nearest-even with MBITS mantissa bits and fp32's exponent range (the
    e8mY formats; BF16 (e8m7) through the conversion to bfloat16; FP32 (23): x unchanged), returned
    as fp32. On the bit pattern: add half a quantum minus one plus the kept last bit, then clear the
    dropped bits (a carry raises the exponent), as ``numerics.round_to`` does for these formats."""
    if MBITS == BF16:
        y = to_bf16(x, INTERP)
    elif MBITS == FP32:
        y = x
    else:
        DROP: tl.constexpr = 23 - MBITS
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & -(1 << DROP)
        y = bits.to(tl.float32, bitcast=True)
    return y


@triton.jit
def _add_random_bits(x, DROP: tl.constexpr, r):
    """x (fp32) with the low DROP bits of the random ``r`` (uint32) added to its bit pattern and then
    those DROP bits cleared: rounded stochastically to 23 − DROP mantissa bits, up with probability
    equal to its distance from the lower neighbour in quanta (infinities and NaN not handled)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + (r & ((1 << DROP) - 1)).to(tl.int32, bitcast=True)) & -(1 << DROP)).to(tl.float32, bitcast=True)


@triton.jit
def round_mantissa_stochastic(x, MBITS: tl.constexpr, seed, offsets):
    """x (fp32) rounded stochastically to MBITS mantissa bits (BF16: 7; FP32: unchanged), returned
    as fp32: a uniform random integer below the dropped bits' range is added to the bit pattern
    and the dropped bits are cleared, so the magnitude rounds up with probability equal to its
    distance from the lower neighbour in quanta — unbiased, whatever the sign. ``offsets``
    (int32, x's shape) and ``seed`` pick independent Philox streams; infinities and NaN pass
    unchanged."""
    if MBITS == FP32:
        y = x
    else:
        DROP: tl.constexpr = 23 - MBITS
        y = _add_random_bits(x, DROP, tl.randint(seed, offsets))          # Philox: uint32
        y = tl.where(tl.abs(x) < float("inf"), y, x)
    return y


@triton.jit
def _round_small(x, M: tl.constexpr, MIN_NORMAL: tl.constexpr, QUANTUM: tl.constexpr, MAX: tl.constexpr,
                 SATURATE: tl.constexpr, INTERP: tl.constexpr, SR: tl.constexpr, seed, offsets):
    """x (fp32) rounded in a format with M mantissa bits, normal numbers from MIN_NORMAL, subnormals
    in steps of QUANTUM and largest finite value MAX (beyond it: ±MAX when SATURATE, as
    float8_e4m3fn, else ±inf), returned as fp32 — as ``numerics.round_to`` does, to nearest-even or,
    with SR, stochastically (up with probability equal to the distance from the lower neighbour in
    quanta). Stochastic: normal magnitudes as ``round_mantissa_stochastic``; below MIN_NORMAL,
    k = |x|/QUANTUM (exact) goes up from floor(k) when a uniform u on 24 bits is below k − floor(k)
    (exact too): the probability is that fraction to 2⁻²⁴, and a representable x never moves. One
    Philox draw serves both; infinities go as nearest-even takes them. NaN stays NaN."""
    if SR:
        r = tl.randint(seed, offsets)                                 # uint32
        y = _add_random_bits(x, 23 - M, r)
        u = (r >> 8).to(tl.float32) * (1.0 / 16777216.0)            # [0, 1), 24 bits
        k = tl.abs(x) * (1.0 / QUANTUM)
        low = tl.floor(k)
        sub = (low + tl.where(u < k - low, 1.0, 0.0)) * QUANTUM
        y = tl.where(tl.abs(x) < MIN_NORMAL, tl.where(x < 0, -sub, sub), y)
        y = tl.where(tl.abs(x) < float("inf"), y, x)                  # ±inf: not through the bit pattern
    else:
        y = round_mantissa(x, M, INTERP)
        # below MIN_NORMAL: nearest-even multiple of QUANTUM (|x|/QUANTUM < 2^M: 1.5·2^23 rounds it)
        sub = ((x * (1.0 / QUANTUM) + 12582912.0) - 12582912.0) * QUANTUM
        y = tl.where(tl.abs(x) < MIN_NORMAL, sub, y)
    over = tl.abs(y) > MAX
    if SATURATE:
        y = tl.where(over, tl.where(x < 0, -MAX, MAX), y)
    else:
        y = tl.where(over, tl.where(x < 0, float("-inf"), float("inf")), y)
    return tl.where(x == x, y, x)                     # NaN stays NaN


@triton.jit
def round_format(x, FMT: tl.constexpr, INTERP: tl.constexpr, SR: tl.constexpr = False, seed=0, offsets=0):
    """x (fp32) rounded in format FMT (a ``config.Format`` value: e8mY, BF16, FP32, FP16, E5M2, E4M3), returned as
    fp32: to nearest-even or, with SR, stochastically (``seed`` and ``offsets`` pick the Philox
    streams)."""
    if FMT == FP16:
        y = _round_small(x, 10, 6.103515625e-05, 5.9604644775390625e-08, 65504.0, False, INTERP, SR, seed, offsets)
    elif FMT == E5M2:
        y = _round_small(x, 2, 6.103515625e-05, 1.52587890625e-05, 57344.0, False, INTERP, SR, seed, offsets)
    elif FMT == E4M3:
        y = _round_small(x, 3, 0.015625, 0.001953125, 448.0, True, INTERP, SR, seed, offsets)
    elif SR:
        y = round_mantissa_stochastic(x, FMT, seed, offsets)
    else:
        y = round_mantissa(x, FMT, INTERP)
    return y


@triton.jit
def narrow(x, FMT: tl.constexpr, SR: tl.constexpr, seed, offsets, INTERP: tl.constexpr):
    """One narrowing point to format FMT (a ``config.Format`` value): nearest-even or, with SR,
    stochastic (``round_format``)."""
    return round_format(x, FMT, INTERP, SR, seed, offsets)


# the largest shift at which the row maximum's P̄ = exp(−shift) is a normal bf16 number: 126·ln 2
BF16_SHIFT_LIMIT = tl.constexpr(87.33654475055310)


@triton.jit
def bound_rounded_shift(m_new, m_prev, r_new, STAB: tl.constexpr):
    """After the shift was rounded up into bf16 (``shift.bound_rounded_shift``): where that put it
    more than BF16_SHIFT_LIMIT above the row maximum r_new, the bounded rules fall back to the
    standard shift max(m_prev, r_new), which bf16 holds exactly. Natural units."""
    if STAB == TIE_SHIFT or STAB == ALL_SHIFT:
        m_new = tl.where(m_new - r_new > BF16_SHIFT_LIMIT, tl.maximum(m_prev, r_new), m_new)
    return m_new


@triton.jit
def tanh(x, FAST: tl.constexpr):
    """tanh of fp32 x. FAST (the GPU's fast path): the hardware's tanh.approx.f32, one special-
    function instruction (relative error below 2⁻¹⁰·⁹⁸⁷, finer than bf16's 2⁻⁸). Otherwise through
    the sigmoid, 2σ(2x) − 1: the interpreter has no PTX, and the "paper" policy's emulation keeps
    the accurate form so that its bf16-rounded scores match the emulated backend's."""
    if FAST:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def keep_hp(x, narrowed, hp, HP: tl.constexpr):
    """``narrowed``, or x itself where this head keeps fp32 (HP and hp true)."""
    if HP:
        narrowed = tl.where(hp, x, narrowed)
    return narrowed


@triton.jit
def fp32(x):
    """A kernel's float argument in fp32: Triton's launch passes a Python float as fp32, a launch
    from torch.compile's generated code as fp64 (its scalar arithmetic would then run in fp64)."""
    return tl.cast(x, tl.float32)


@triton.jit
def p_bar_v(p, v, v8, hp, PBAR32: tl.constexpr, HP: tl.constexpr, INTERP: tl.constexpr,
            PFMT: tl.constexpr, FP8_PV: tl.constexpr = False):
    """P̄V with fp32 accumulation: P̄ rounded to V's dtype for the tensor cores, or (PBAR32, or a head
    kept in fp32) multiplied in fp32. PFMT other than NO_FORMAT: P̄ rounded to that format first
    (``round_format``); bf16, e8mY and fp8 values are exact in bf16, fp16 values in tf32, so the
    products stay exact. FP8_PV (PFMT E4M3 or E5M2): P̄ rounded to that fp8 format (on the GPU by
    the conversion itself, which rounds to nearest-even, subnormals included, as ``round_format``)
    and multiplied with ``v8``, V already in it (the launcher converts V once per call), on the fp8
    tensor cores (FP8 attention; Hopper's fp8 products accumulate with fewer bits than fp32); the
    interpreter's ``v8`` holds the same values in V's dtype, multiplied in fp32. Otherwise ``v8``
    is not read."""
    if PBAR32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        if FP8_PV:
            if INTERP:
                pv = mma(cast(round_format(p, PFMT, INTERP), v8.dtype, INTERP), v8, INTERP)
            else:                                      # the GPU's conversion rounds to nearest-even as
                pv = tl.dot(p.to(v8.dtype), v8)        # round_format does (test_the_gpus_fp8_conversion…)
        elif PFMT == FP16:
            pv = tl.dot(round_format(p, PFMT, INTERP), v.to(tl.float32), input_precision="tf32")
        elif PFMT != NO_FORMAT:
            pv = mma(cast(round_format(p, PFMT, INTERP), v.dtype, INTERP), v, INTERP)
        else:
            pv = mma(cast(p, v.dtype, INTERP), v, INTERP)
        if HP:                                         # fp32 heads: the unrounded P̄, multiplied in fp32
            pv = tl.where(hp, tl.dot(p, v.to(tl.float32), input_precision="ieee"), pv)
    return pv


@triton.jit
def mma(a, b, INTERP: tl.constexpr):
    """a @ b with fp32 accumulation. INTERP multiplies in fp32 ("ieee"): the Triton CPU
    interpreter's bf16 dot is wrong; bf16 and fp16 products are exact in fp32, so the result is
    what the tensor cores compute, up to the order of the fp32 additions."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


# the attn_mask switch MASK_KIND: none, boolean (True = take part) or additive (float, natural units)
MASK_NONE = tl.constexpr(0)
MASK_BOOL = tl.constexpr(1)
MASK_ADD = tl.constexpr(2)


@triton.jit
def keys_kept(rows, cols, n_k, CAUSAL: tl.constexpr):
    """Which (query, key) entries of a tile take part before any band, attn_mask or dropout: keys past
    n_k never; with CAUSAL (top-left) key j for query i when j ≤ i. One comparison an entry: under
    CAUSAL j ≤ min(i, n_k − 1), the bound taken once a row (comparing j < n_k and j ≤ i apart and
    combining them costs more instructions an entry)."""
    if CAUSAL:
        keep = cols[None, :] <= tl.minimum(rows, n_k - 1)[:, None]
    else:
        keep = cols[None, :] < n_k
    return keep


@triton.jit
def in_band(i, j, diag, left, right):
    """Whether key j is visible to query i (``masking.visible``): diag + i − left ≤ j ≤ diag + i + right,
    diag the diagonal's key for query 0 (0 top-left, n_k − n_q bottom-right), an unbounded side
    given as a bound beyond every index."""
    d = i + diag
    return (j >= d - left) & (j <= d + right)


@triton.jit
def _floor_to(x, BLOCK: tl.constexpr):
    return (x // BLOCK) * BLOCK


@triton.jit
def key_ranges(first, n_rows, n_cols, lo_of_first, hi_of_first, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(lo, mid_lo, mid_hi, hi): the columns [lo, hi) that rows [first, first + BLOCK_R) of a band
    can see, lo and mid_lo, mid_hi multiples of BLOCK_C, split into a masked leading edge [lo,
    mid_lo), a middle [mid_lo, mid_hi) of blocks every one of these rows sees whole (no mask), and
    a masked trailing edge [mid_hi, hi). Row r sees columns r + lo_of_first … r + hi_of_first
    (inclusive; for the forward lo_of_first = diag − left, hi_of_first = diag + right; for a key
    block's queries the same band read from the other side). ``n_rows``: the rows that exist (a
    block at or past it sees nothing: a varlen program past its sequence's end). The indices are
    clamped to [0, n_cols] before any division (Triton's integer division truncates on the GPU
    and floors in the interpreter)."""
    last = first + (BLOCK_R - 1)
    lo = _floor_to(tl.minimum(tl.maximum(first + lo_of_first, 0), n_cols), BLOCK_C)
    hi = tl.minimum(tl.maximum(last + hi_of_first + 1, 0), n_cols)
    hi = tl.where(first < n_rows, hi, 0)
    hi = tl.maximum(hi, lo)
    mid_lo = _floor_to(tl.minimum(tl.maximum(last + lo_of_first, 0), n_cols) + (BLOCK_C - 1), BLOCK_C)
    mid_lo = tl.minimum(tl.maximum(mid_lo, lo), _floor_to(hi + (BLOCK_C - 1), BLOCK_C))
    mid_hi = _floor_to(tl.minimum(tl.maximum(first + hi_of_first + 1, 0), n_cols), BLOCK_C)
    mid_hi = tl.maximum(tl.minimum(mid_hi, hi), mid_lo)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def load_mask_tile(MP, rows, cols, n_q, n_k, stride_mm, stride_mn, MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr):
    """The attn_mask tile (rows, cols) at ``MP`` (this batch element's and head's base): booleans
    (stored as bytes) or fp32 additive values; outside the matrix True or 0. Without MASK_ROWS
    (row stride 0: a key-padding mask) one row is read and broadcast."""
    if MASK_ROWS:
        inside = (rows[:, None] < n_q) & (cols[None, :] < n_k)
        m = tl.load(MP + rows[:, None] * stride_mm + cols[None, :] * stride_mn, mask=inside, other=1 if MASK_KIND == MASK_BOOL else 0.0)
    else:
        m = tl.load(MP + cols * stride_mn, mask=cols < n_k, other=1 if MASK_KIND == MASK_BOOL else 0.0)[None, :]
    if MASK_KIND == MASK_BOOL:
        m = m != 0
    else:
        m = m.to(tl.float32)
    return m


@triton.jit
def dropout_keep(seed, threshold, i, j, bh):
    """Dropout's keep decision for query i, key j of sequence·head bh (broadcast together), as
    ``masking.dropout_keep``: the first output of Philox-4x32-10 keyed by ``seed`` with counter (j,
    i, bh, 0), as uint32, not below ⌊p·2³²⌋. ``threshold`` is ⌊p·2³²⌋ − 2³¹ (an int32 whatever p):
    the comparison runs in int32 on r with its top bit flipped, which keeps the unsigned order."""
    c0 = (j + i * 0).to(tl.uint32, bitcast=True)
    c1 = (i + j * 0).to(tl.uint32, bitcast=True)
    c2 = (c0 * 0 + bh).to(tl.uint32, bitcast=True)
    r, _, _, _ = tl.philox(seed, c0, c1, c2, c2 * 0)
    return (r ^ 0x80000000).to(tl.int32, bitcast=True) >= threshold
