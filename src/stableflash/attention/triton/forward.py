"""FlashAttention-2 forward (Algorithm 1) in Triton, with the stabilized row maximum.

One program computes BLOCK_M query rows of one (batch, head): it walks the key blocks, updating
the running shift m (``rule.next_shift``), the row sum ℓ and the accumulator Ō, and writes
O = Ō/ℓ and the log-sum-exp L = m + log ℓ (natural log, fp32) for the backward pass.

Two arithmetic modes, chosen at compile time:
- EMU = 0 ("fa2"): scores in fp32 and log2 units, P̄ rounded to the input dtype for P̄V, ℓ and Ō
  in fp32 — what fused kernels do.
- EMU = 1 ("paper", bf16 only): the authors' emulation, matching the emulated backend's "paper"
  policy — S, the shift and S − m in bf16 (natural units), and ℓ and Ō rounded to bf16 after every
  key block.
The switches take the values of the configuration's enums (``config.py``; ``common`` names them).
FMT, a ``Format``, is the format of the narrowing points: ℓ, Ō and O under "paper" and O under
"fa2", each in it where ROW_NARROW, ACC_NARROW, O_NARROW say (a policy's fp32 point is left out):
e8mY, rounded to nearest-even — the accelerated stand-ins of the reproduction, where the bias bf16
shows over thousands of steps appears in hundreds — or bf16, fp16, fp8; FP32 narrows nothing (the
high-precision control; O is then rounded once, on the store). An O in the format of its own
dtype is rounded by the store alone. SR rounds those narrowing points, and the bf16 O store,
stochastically instead of to nearest (unbiased; ``seed`` and the element's place pick the random
bits, so a call is reproducible). PBAR32 multiplies P̄V with P̄ in fp32 (no tensor-core rounding
of P̄); PFMT rounds P̄ to that format (bf16, e8mY, fp16, e5m2, e4m3: ``common.round_format``)
before the product, and FP8_PV multiplies that fp8 P̄ with V in the same format on the fp8 tensor
cores; HP keeps P̄, Ō, ℓ and O in fp32 for the heads set in ``hp_mask`` (a policy's
``hp_heads``). SOFTCAP soft-caps the scores (softcap·tanh(S/softcap); the launcher passes cap_in,
cap_out in the mode's units).
DELTA_SRC, a ``DeltaSource``, says what the forward keeps for the backward's δ = rowsum(dO ∘ O):
- DELTA_O_FP32 (δ from dO·O under an fp32 ``out`` or fp32 heads): O in fp32 as the policy stores
  it (before it is rounded to the input dtype for the model), at the cost of one fp32 store;
- DELTA_O32 ("dO·O32"): O as computed, Ō/ℓ before any rounding of the store, in fp32 (an exact O
  for δ while the model gets the policy's format);
- DELTA_O16 ("fa2" only; "dO·O16"): also accumulates P̄V with P̄ in the input dtype beside the
  policy's product (one more product per key block) and stores that O in fp32: the O of a 16-bit
  kernel for δ while the model gets the O of a narrower P̄ (fp8);
- DELTA_O_R ("dO·(O+R)"): instead of an fp32 O, the residual R = O as computed − O as stored,
  rounded to the input dtype (O32 then points to a tensor of that dtype): O + R holds O to about
  twice the input format's bits, in half the bytes;
- DELTA_O16_R ("dO·(O16+R)"): the 16-bit product's O as DELTA_O16 computes it, kept as DELTA_O_R
  keeps O as computed: as the residual of the O store, in the input dtype;
- any other source: nothing.
"""
import triton
import triton.language as tl

from stableflash.attention.triton.common import (BF16, DELTA_O16, DELTA_O16_R, DELTA_O32, DELTA_O_FP32, DELTA_O_R,
                                                 FP16, NO_FORMAT, HP_LIMIT, MASK_ADD, MASK_BOOL, PAPER, TIE_SHIFT,
                                                 bound_rounded_shift, cast, count_ties, dropout_keep, fp32,
                                                 in_band, keep_hp, key_ranges, keys_kept, load_mask_tile, mma, narrow,
                                                 next_shift, p_bar_v, round_up_bf16, shift_from_ties, tanh, to_bf16)

LOG2E = 1.4426950408889634


@triton.jit
def _fwd_blocks(acc, acc16, l_i, m_i, r_i, q, K, V, V8, stride_kn, stride_vn, offs_m, offs_d, start, stop, n_k,
                scale, beta, eps, lo, hi, period, seed, rows, hp, cap_in, cap_out,
                BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                STAB: tl.constexpr, EMU: tl.constexpr, FMT: tl.constexpr, SR: tl.constexpr,
                ACC_NARROW: tl.constexpr, ROW_NARROW: tl.constexpr, PBAR32: tl.constexpr, HP: tl.constexpr,
                PFMT: tl.constexpr, FP8_PV: tl.constexpr, SOFTCAP: tl.constexpr, O16: tl.constexpr,
                TMA: tl.constexpr, INTERP: tl.constexpr,
                n_q=0, n_k8=0, diag=0, left=0, right=0, MP=0, stride_mm=0, stride_mn=0, mask_mul=1.0,
                drop_seed=0, drop_thr=0, drop_bh=0,
                BAND: tl.constexpr = False, MASK_KIND: tl.constexpr = 0, MASK_ROWS: tl.constexpr = False,
                DROPOUT: tl.constexpr = False, SAFE: tl.constexpr = False):
    """Lines 6-11 of Algorithm 1 for key blocks [start, stop). TMA: K and V are tensor
    descriptors (rows past n_k come back as zeros) instead of pointers. ``rows``: the rows' indices
    over the whole (batch, head, query) grid, which with ``seed`` and the key block number pick the
    random streams of stochastic rounding (SR). ``hp`` (with HP): this head keeps P̄, Ō and ℓ in fp32.
    O16 ("fa2" mode): ``acc16`` accumulates P̄V with P̄ in the input dtype beside ``acc``. An fp8
    product (FP8_PV) reads V from ``V8``, V converted to fp8 with the keys contiguous (what
    the fp8 tensor cores take), and V itself only where the 16-bit product or an fp32 head needs it.

    The masks (each behind its switch, applied below): BAND, key j visible
    to query i when diag + i − left ≤ j ≤ diag + i + right (in MASKED blocks only: the launcher's
    ranges leave the unmasked ones out); MASK_KIND (BOOL or ADD) an attn_mask tile read at ``MP``
    through its strides (one row per block without MASK_ROWS), in every block; SAFE: a row may
    have seen no key yet (running maximum −inf), so the exponentials subtract 0 there instead.
    DROPOUT: P̄ enters P̄V through the Philox keep mask of (drop_seed; j, i, drop_bh, 0); ℓ sums
    the undropped P (the 1/(1 − p) is applied to O at the end)."""
    offs_n = tl.arange(0, BLOCK_N)
    BF16_V: tl.constexpr = not FP8_PV or O16 or HP
    for start_n in range(start, stop, BLOCK_N):
        cols = start_n + offs_n
        v = 0.0                                    # placeholders for the operand a mode does not read
        v8 = 0.0
        if TMA:
            k = tl.trans(K.load([start_n, 0]))
            if BF16_V:
                v = V.load([start_n, 0])
        elif MASKED:
            k = tl.load(K + cols[None, :] * stride_kn + offs_d[:, None], mask=cols[None, :] < n_k, other=0.0)
            if BF16_V:
                v = tl.load(V + cols[:, None] * stride_vn + offs_d[None, :], mask=cols[:, None] < n_k, other=0.0)
        else:
            k = tl.load(K + cols[None, :] * stride_kn + offs_d[:, None])
            if BF16_V:
                v = tl.load(V + cols[:, None] * stride_vn + offs_d[None, :])
        if FP8_PV:                                 # V8: (HEAD_DIM, n_k) per head, keys contiguous
            if MASKED:
                v8 = tl.load(V8 + offs_d[None, :] * n_k8 + cols[:, None], mask=cols[:, None] < n_k, other=0.0)
            else:
                v8 = tl.load(V8 + offs_d[None, :] * n_k8 + cols[:, None])
        qk = mma(q, k, INTERP)
        if SOFTCAP and not EMU:                # capped scores in log2 units: cap_out·tanh(qk·cap_in); scale = 1
            qk = cap_out * tanh(qk * cap_in, not INTERP)
        mv = 0.0
        if MASK_KIND != 0:
            mv = load_mask_tile(MP, offs_m, cols, n_q, n_k, stride_mm, stride_mn, MASK_KIND, MASK_ROWS)
            if MASK_KIND == MASK_ADD and not EMU:   # natural units into the kernel's: qk·scale + mv·log2 e
                qk = qk + mv * mask_mul
            if MASK_KIND == MASK_BOOL:
                qk = tl.where(mv, qk, float("-inf"))
        if MASKED:
            keep = keys_kept(offs_m, cols, n_k, CAUSAL)
            if BAND:
                keep = keep & in_band(offs_m[:, None], cols[None, :], diag, left, right)
            qk = tl.where(keep, qk, float("-inf"))
        if EMU:                                    # the "paper" policy: bf16 scores, natural units
            s = to_bf16(qk * scale, INTERP)
            if SOFTCAP:                            # natural units: softcap·tanh(S/softcap), rounded again
                s = tl.where(s > float("-inf"), to_bf16(cap_out * tanh(s * cap_in, False), INTERP), s)
            if MASK_KIND == MASK_ADD:              # S + attn_mask, held in bf16 as S is
                s = to_bf16(s + mv, INTERP)
            m_new, r_i = next_shift(s, m_i, r_i, STAB, beta, eps, lo, hi, period)
            m_new = bound_rounded_shift(round_up_bf16(m_new), m_i, r_i, STAB)
            if SAFE:                               # no key seen yet: subtract 0, not −inf
                m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
                p = tl.exp2(to_bf16(s - m_use[:, None], INTERP) * 1.4426950408889634)
                alpha = tl.exp2((m_i - m_use) * 1.4426950408889634)
            else:
                p = tl.exp2(to_bf16(s - m_new[:, None], INTERP) * 1.4426950408889634)
                alpha = tl.exp2((m_i - m_new) * 1.4426950408889634)
            blk = 3 * (start_n // BLOCK_N)         # streams 3b (Ō) and 3b + 1 (ℓ) of key block b
            l_i = l_i * alpha + tl.sum(p, 1)
            if ROW_NARROW:
                l_i = keep_hp(l_i, narrow(l_i, FMT, SR, seed + blk + 1, rows, INTERP), hp, HP)
            if DROPOUT:
                p = tl.where(dropout_keep(drop_seed, drop_thr, offs_m[:, None], cols[None, :], drop_bh), p, 0.0)
            acc = acc * alpha[:, None] + p_bar_v(p, v, v8, hp, PBAR32, HP, INTERP, PFMT, FP8_PV)
            if ACC_NARROW:
                acc = keep_hp(acc, narrow(acc, FMT, SR, seed + blk, rows[:, None] * acc.shape[1] + offs_d[None, :],
                                          INTERP), hp, HP)
        else:                                      # log2 units; the scale is applied per row and in one FMA
            rm = tl.max(qk, 1) * scale
            ties = rm * 0.0
            if STAB == PAPER or STAB == TIE_SHIFT:  # count entries within eps of the max
                ties = count_ties(qk, (rm - eps) * (1.0 / scale))   # 1/scale: once per program, not per row
            m_new, r_i = shift_from_ties(rm, ties, m_i, r_i, STAB, beta, eps, lo, hi, period)
            if SAFE:                               # no key seen yet: subtract 0, not −inf
                m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
                p = tl.exp2(qk * scale - m_use[:, None])
                alpha = tl.exp2(m_i - m_use)
            else:
                p = tl.exp2(qk * scale - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if DROPOUT:
                p = tl.where(dropout_keep(drop_seed, drop_thr, offs_m[:, None], cols[None, :], drop_bh), p, 0.0)
            acc = acc * alpha[:, None] + p_bar_v(p, v, v8, hp, PBAR32, HP, INTERP, PFMT, FP8_PV)
            if O16:                                # the 16-bit product beside the policy's, for δ
                acc16 = acc16 * alpha[:, None] + p_bar_v(p, v, v, hp, False, False, INTERP, NO_FORMAT)
        m_i = m_new
    return acc, acc16, l_i, m_i, r_i


@triton.jit
def _fwd_masked(acc, acc16, l_i, m_i, r_i, q, K, V, V8, stride_kn, stride_vn, offs_m, offs_d, start_m, n_q, n_k, n_k8,
                scale, beta, eps, lo, hi, period, seed, rows, hp, cap_in, cap_out,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAB: tl.constexpr, EMU: tl.constexpr,
                FMT: tl.constexpr, SR: tl.constexpr, ACC_NARROW: tl.constexpr, ROW_NARROW: tl.constexpr,
                PBAR32: tl.constexpr, HP: tl.constexpr, PFMT: tl.constexpr, FP8_PV: tl.constexpr,
                SOFTCAP: tl.constexpr, O16: tl.constexpr, TMA: tl.constexpr, INTERP: tl.constexpr,
                CAUSAL: tl.constexpr, bh, b, h, MASK, stride_mb, stride_mh, stride_mm, stride_mn, mask_mul,
                left, right, align_br, drop_seed, drop_thr,
                BAND: tl.constexpr, VARLEN: tl.constexpr, MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr,
                DROPOUT: tl.constexpr):
    """The key loop with any of the masking switches on: the keys this block of rows can see, in
    three ranges — a masked leading edge, a middle of whole blocks every row sees (no positional
    mask), a masked trailing edge (the band's far side and the ragged tail). Blocks no row sees
    are skipped. CAUSAL (top-left, no window) uses the kernel's own two ranges."""
    SAFE: tl.constexpr = BAND or VARLEN or MASK_KIND != 0
    diag = align_br * (n_k - n_q)
    if BAND:
        k_lo, mid_lo, mid_hi, k_hi = key_ranges(start_m, n_q, n_k, diag - left, diag + right, BLOCK_M, BLOCK_N)
    elif CAUSAL:
        k_lo = 0
        k_hi = tl.minimum(n_k, start_m + BLOCK_M)
        k_hi = tl.where(start_m < n_q, k_hi, 0)
        mid_lo = 0
        mid_hi = tl.minimum((n_k // BLOCK_N) * BLOCK_N, (start_m // BLOCK_N) * BLOCK_N)
        mid_hi = tl.minimum(mid_hi, k_hi)
    else:
        k_lo = 0
        k_hi = tl.where(start_m < n_q, n_k, 0)
        mid_lo = 0
        mid_hi = (k_hi // BLOCK_N) * BLOCK_N
    MP = MASK
    if MASK_KIND != 0:
        MP = MASK + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    acc, acc16, l_i, m_i, r_i = _fwd_blocks(acc, acc16, l_i, m_i, r_i, q, K, V, V8, stride_kn, stride_vn, offs_m,
                                            offs_d, k_lo, mid_lo, n_k, scale, beta, eps, lo, hi, period, seed, rows,
                                            hp, cap_in, cap_out, BLOCK_N, CAUSAL, True, STAB, EMU, FMT, SR, ACC_NARROW,
                                            ROW_NARROW, PBAR32, HP, PFMT, FP8_PV, SOFTCAP, O16, TMA, INTERP,
                                            n_q, n_k8, diag, left, right, MP, stride_mm, stride_mn, mask_mul,
                                            drop_seed, drop_thr, bh, BAND, MASK_KIND, MASK_ROWS, DROPOUT, SAFE)
    acc, acc16, l_i, m_i, r_i = _fwd_blocks(acc, acc16, l_i, m_i, r_i, q, K, V, V8, stride_kn, stride_vn, offs_m,
                                            offs_d, mid_lo, mid_hi, n_k, scale, beta, eps, lo, hi, period, seed, rows,
                                            hp, cap_in, cap_out, BLOCK_N, CAUSAL, False, STAB, EMU, FMT, SR,
                                            ACC_NARROW, ROW_NARROW, PBAR32, HP, PFMT, FP8_PV, SOFTCAP, O16, TMA,
                                            INTERP, n_q, n_k8, diag, left, right, MP, stride_mm, stride_mn, mask_mul,
                                            drop_seed, drop_thr, bh, BAND, MASK_KIND, MASK_ROWS, DROPOUT,
                                            MASK_KIND != 0)
    acc, acc16, l_i, m_i, r_i = _fwd_blocks(acc, acc16, l_i, m_i, r_i, q, K, V, V8, stride_kn, stride_vn, offs_m,
                                            offs_d, mid_hi, k_hi, n_k, scale, beta, eps, lo, hi, period, seed, rows,
                                            hp, cap_in, cap_out, BLOCK_N, CAUSAL, True, STAB, EMU, FMT, SR, ACC_NARROW,
                                            ROW_NARROW, PBAR32, HP, PFMT, FP8_PV, SOFTCAP, O16, TMA, INTERP,
                                            n_q, n_k8, diag, left, right, MP, stride_mm, stride_mn, mask_mul,
                                            drop_seed, drop_thr, bh, BAND, MASK_KIND, MASK_ROWS, DROPOUT, SAFE)
    return acc, acc16, l_i, m_i, r_i


@triton.jit
def attn_fwd_kernel(Q, K, V, V8, O, LSE, O32,
                    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                    n_heads, group, n_q, n_k, n_bh, scale, beta, eps, lo, hi, period, seed, hp_mask, cap_in, cap_out,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, STAB: tl.constexpr, EMU: tl.constexpr, FMT: tl.constexpr,
                    SR: tl.constexpr, ACC_NARROW: tl.constexpr, ROW_NARROW: tl.constexpr, O_NARROW: tl.constexpr,
                    PBAR32: tl.constexpr, HP: tl.constexpr, PFMT: tl.constexpr, FP8_PV: tl.constexpr,
                    SOFTCAP: tl.constexpr, DELTA_SRC: tl.constexpr, PERSISTENT: tl.constexpr,
                    TMA: tl.constexpr, INTERP: tl.constexpr,
                    CU_Q=0, CU_K=0, MASK=0, stride_mb=0, stride_mh=0, stride_mm=0, stride_mn=0, mask_mul=1.0,
                    left=0, right=0, align_br=0, drop_seed=0, drop_thr=0, drop_scale=1.0,
                    BAND: tl.constexpr = False, VARLEN: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
                    MASK_ROWS: tl.constexpr = False, DROPOUT: tl.constexpr = False):
    """One (query block, batch·head) tile per program on a (query blocks, n_bh) grid; or, with
    PERSISTENT, a 1-D grid of a few programs per SM, each walking tiles program_id, program_id +
    num_programs, ... of one list ordered longest first over every head (a persistent grid).

    The masking switches (all off: the kernel is the one without them): BAND, a causal diagonal
    off the top-left or a window (bounds ``left``, ``right``, the diagonal bottom-right aligned
    when ``align_br``); VARLEN, sequences packed along the token axis with boundaries ``CU_Q`` and
    ``CU_K`` (int32, n_seq + 1), the grid's first axis then sequence·head (``op.varlen_grid``)
    and n_q, n_k the totals; MASK_KIND, an attn_mask at ``MASK`` (B, H, Nq, Nk) with strides (0 where broadcast);
    DROPOUT, attention dropout (seed, threshold ⌊p·2³²⌋, 1/(1 − p)). Not with PERSISTENT."""
    scale, beta, eps, lo, hi, period = fp32(scale), fp32(beta), fp32(eps), fp32(lo), fp32(hi), fp32(period)
    cap_in, cap_out, mask_mul, drop_scale = fp32(cap_in), fp32(cap_out), fp32(mask_mul), fp32(drop_scale)
    if PERSISTENT:
        n_m = tl.cdiv(n_q, BLOCK_M)
        for tile in range(tl.program_id(0), n_m * n_bh, tl.num_programs(0)):
            _fwd_tile((n_m - 1 - tile // n_bh) * BLOCK_M, tile % n_bh, Q, K, V, V8, O, LSE, O32,
                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                      n_heads, group, n_q, n_k, scale, beta, eps, lo, hi, period, seed, hp_mask, cap_in, cap_out,
                      HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, STAB, EMU, FMT, SR, ACC_NARROW, ROW_NARROW, O_NARROW,
                      PBAR32, HP, PFMT, FP8_PV, SOFTCAP, DELTA_SRC, TMA, INTERP)
    else:
        # the last query blocks see the most keys under a causal mask: launch them first, so that
        # the grid's tail is made of short programs (longest-processing-time-first scheduling)
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
        bh = tl.program_id(1)
        if VARLEN:                             # sequence·head on the first axis (``op.varlen_grid``)
            start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
            bh = tl.program_id(0)
        _fwd_tile(start_m, bh, Q, K, V, V8, O, LSE, O32,
                  stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                  n_heads, group, n_q, n_k, scale, beta, eps, lo, hi, period, seed, hp_mask, cap_in, cap_out,
                  HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, STAB, EMU, FMT, SR, ACC_NARROW, ROW_NARROW, O_NARROW,
                  PBAR32, HP, PFMT, FP8_PV, SOFTCAP, DELTA_SRC, TMA, INTERP,
                  CU_Q, CU_K, MASK, stride_mb, stride_mh, stride_mm, stride_mn, mask_mul,
                  left, right, align_br, drop_seed, drop_thr, drop_scale,
                  BAND, VARLEN, MASK_KIND, MASK_ROWS, DROPOUT)


@triton.jit
def _fwd_tile(start_m, bh, Q, K, V, V8, O, LSE, O32,
              stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
              n_heads, group, n_q, n_k, scale, beta, eps, lo, hi, period, seed, hp_mask, cap_in, cap_out,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, STAB: tl.constexpr, EMU: tl.constexpr, FMT: tl.constexpr,
              SR: tl.constexpr, ACC_NARROW: tl.constexpr, ROW_NARROW: tl.constexpr, O_NARROW: tl.constexpr,
              PBAR32: tl.constexpr, HP: tl.constexpr, PFMT: tl.constexpr, FP8_PV: tl.constexpr,
              SOFTCAP: tl.constexpr, DELTA_SRC: tl.constexpr, TMA: tl.constexpr, INTERP: tl.constexpr,
              CU_Q=0, CU_K=0, MASK=0, stride_mb=0, stride_mh=0, stride_mm=0, stride_mn=0, mask_mul=1.0,
              left=0, right=0, align_br=0, drop_seed=0, drop_thr=0, drop_scale=1.0,
              BAND: tl.constexpr = False, VARLEN: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
              MASK_ROWS: tl.constexpr = False, DROPOUT: tl.constexpr = False):
    """Query rows [start_m, start_m + BLOCK_M) of batch·head ``bh``: Algorithm 1 and the stores.
    VARLEN: ``bh`` is sequence·head, and the rows are the sequence's."""
    b, h = bh // n_heads, bh % n_heads
    hk = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    n_k8 = n_k                                 # V8's row length (the keys of one head)
    if VARLEN:                                 # sequence b of the packed batch; b = 0 for the strides
        q_start = tl.load(CU_Q + b)
        k_start = tl.load(CU_K + b)
        row0 = h * n_q + q_start               # LSE and O32 rows: (1, H, total_q)
        n_q = tl.load(CU_Q + b + 1) - q_start
        n_k = tl.load(CU_K + b + 1) - k_start
        b = 0
        Q += q_start.to(tl.int64) * stride_qm
        K += k_start.to(tl.int64) * stride_kn
        V += k_start.to(tl.int64) * stride_vn
        O += q_start.to(tl.int64) * stride_om
    else:
        row0 = bh * n_q
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    if FP8_PV:                                 # V8 is (B, H_kv, HEAD_DIM, n_k), contiguous
        if VARLEN:
            V8 += hk.to(tl.int64) * (HEAD_DIM * n_k8) + k_start
        else:
            V8 += (b * (n_heads // group) + hk).to(tl.int64) * (HEAD_DIM * n_k)
    if TMA:     # device-side descriptors (Hopper's tensor memory accelerator) for the key loop
        K = tl.make_tensor_descriptor(K, shape=[n_k, HEAD_DIM], strides=[stride_kn, 1],
                                      block_shape=[BLOCK_N, HEAD_DIM])
        V = tl.make_tensor_descriptor(V, shape=[n_k, HEAD_DIM], strides=[stride_vn, 1],
                                      block_shape=[BLOCK_N, HEAD_DIM])
    q = tl.load(Q + offs_m[:, None] * stride_qm + offs_d[None, :], mask=offs_m[:, None] < n_q, other=0.0)

    rows = row0 + offs_m                       # this program's rows over the whole grid (SR streams)
    hp = h < 0                                 # a head the policy keeps in fp32 (hp_heads, heads 0-HP_LIMIT)
    if HP:
        hp = (((hp_mask >> tl.minimum(h, HP_LIMIT)) & 1) != 0) & (h <= HP_LIMIT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    r_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc16 = 0.0                                # DELTA_O16, DELTA_O16_R only: P̄V with P̄ in the input dtype
    O16: tl.constexpr = DELTA_SRC == DELTA_O16 or DELTA_SRC == DELTA_O16_R
    RESIDUAL: tl.constexpr = DELTA_SRC == DELTA_O_R or DELTA_SRC == DELTA_O16_R
    KEEP: tl.constexpr = DELTA_SRC == DELTA_O_FP32 or DELTA_SRC == DELTA_O32 or O16 or RESIDUAL
    if O16:
        acc16 = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    if BAND or VARLEN or MASK_KIND != 0 or DROPOUT:
        acc, acc16, l_i, m_i, r_i = _fwd_masked(acc, acc16, l_i, m_i, r_i, q, K, V, V8, stride_kn, stride_vn, offs_m,
                                                offs_d, start_m, n_q, n_k, n_k8, scale, beta, eps, lo, hi, period, seed,
                                                rows, hp, cap_in, cap_out, BLOCK_M, BLOCK_N, STAB, EMU, FMT, SR,
                                                ACC_NARROW, ROW_NARROW, PBAR32, HP, PFMT, FP8_PV, SOFTCAP, O16, TMA,
                                                INTERP, CAUSAL, bh, b, h, MASK, stride_mb, stride_mh, stride_mm,
                                                stride_mn, mask_mul, left, right, align_br, drop_seed, drop_thr,
                                                BAND, VARLEN, MASK_KIND, MASK_ROWS, DROPOUT)
    else:
        # keys [0, full) need no mask; [full, stop) hold the causal diagonal and the ragged tail
        stop = tl.minimum(n_k, start_m + BLOCK_M) if CAUSAL else n_k
        full = (n_k // BLOCK_N) * BLOCK_N
        if CAUSAL:
            full = tl.minimum(full, (start_m // BLOCK_N) * BLOCK_N)
        acc, acc16, l_i, m_i, r_i = _fwd_blocks(acc, acc16, l_i, m_i, r_i, q, K, V, V8, stride_kn, stride_vn, offs_m,
                                                offs_d, 0, full, n_k, scale, beta, eps, lo, hi, period, seed, rows, hp,
                                                cap_in, cap_out, BLOCK_N, CAUSAL, False, STAB, EMU, FMT, SR, ACC_NARROW,
                                                ROW_NARROW, PBAR32, HP, PFMT, FP8_PV,
                                                SOFTCAP, O16, TMA, INTERP, n_k8=n_k8)
        acc, acc16, l_i, m_i, r_i = _fwd_blocks(acc, acc16, l_i, m_i, r_i, q, K, V, V8, stride_kn, stride_vn, offs_m,
                                                offs_d, full, stop, n_k, scale, beta, eps, lo, hi, period, seed, rows, hp,
                                                cap_in, cap_out, BLOCK_N, CAUSAL, True, STAB, EMU, FMT, SR, ACC_NARROW,
                                                ROW_NARROW, PBAR32, HP, PFMT, FP8_PV,
                                                SOFTCAP, O16, TMA, INTERP, n_k8=n_k8)
    if BAND or VARLEN or MASK_KIND != 0:       # a row that saw no key: O = 0, L = −inf
        seen = l_i > 0.0
        l_i = tl.where(seen, l_i, 1.0)
    if EMU:
        o = acc / l_i[:, None]
        lse = m_i + tl.log(l_i)
    else:
        o = acc / l_i[:, None]
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    if BAND or VARLEN or MASK_KIND != 0:
        lse = tl.where(seen, lse, float("-inf"))
    if DROPOUT:                                # the kept entries' 1/(1 − p), once on O
        o = o * drop_scale
        if O16:
            acc16 = acc16 * drop_scale
    # the O store: e8mY, or bf16 rounded stochastically — or a bf16 O that δ reads from the fp32 copy
    # (fp32 heads beside bf16 ones), rounded here so that the copy holds what the policy stores. An
    # O in the format of O's own dtype, nearest-even, needs no rounding before the store's.
    BY_STORE: tl.constexpr = ((FMT == BF16 and O.dtype.element_ty == tl.bfloat16)
                              or (FMT == FP16 and O.dtype.element_ty == tl.float16))
    o32 = o                                    # DELTA_O32: the O that δ reads is O as computed
    if O_NARROW and (not BY_STORE or SR or DELTA_SRC == DELTA_O_FP32):
        o = keep_hp(o, narrow(o, FMT, SR, seed - 1, rows[:, None] * HEAD_DIM + offs_d[None, :], INTERP), hp, HP)
    if DELTA_SRC == DELTA_O_FP32:
        o32 = o                                # O as the policy stores it
    if O16:
        o32 = acc16 / l_i[:, None]             # O of the 16-bit product (ℓ is the same sum)
    if RESIDUAL:                               # the residual of the O store, in O's dtype
        o32 = cast(o32 - cast(o, O.dtype.element_ty, INTERP).to(tl.float32), O32.dtype.element_ty, INTERP)
    if KEEP:                                   # contiguous (B, H, Nq, d), fp32 (or O's dtype: RESIDUAL)
        tl.store(O32 + (row0 + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], o32, mask=offs_m[:, None] < n_q)
    O += b * stride_ob + h * stride_oh
    tl.store(O + offs_m[:, None] * stride_om + offs_d[None, :], cast(o, O.dtype.element_ty, INTERP),
             mask=offs_m[:, None] < n_q)
    tl.store(LSE + row0 + offs_m, lse, mask=offs_m < n_q)
