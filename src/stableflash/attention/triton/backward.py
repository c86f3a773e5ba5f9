"""FlashAttention-2 backward (Algorithm 2) in Triton: δ, then dK/dV per key block and dQ per
query block (two kernels, no atomics, deterministic).

P is recomputed from the saved log-sum-exp, so it is the normalised softmax whatever shift the
forward used. δ comes from one of three computations (the δ source, ``config.DeltaSource``):
- rowsum(dO ∘ O) (``delta_dot_kernel``) with the stored O (DO_O, what kernels do; the term the
  paper blames), with an fp32 O the forward kept, or with O + R (the store's residual, DO_O_R);
- DELTA_DP_P (``delta_pass_kernel``): rowsum(P ∘ dP), dP = dO·Vᵀ, one extra pass over the keys;
- DELTA_RECOMPUTE (``delta_pass_kernel``): rowsum(dO ∘ PV) with PV recomputed in fp32, one extra pass.
EMU = 1 recomputes S in bf16 natural units, as the emulated backend's "paper" policy does.
"""
import triton
import triton.language as tl

from stableflash.attention.triton.common import (DELTA_DP_P, DELTA_RECOMPUTE, MASK_ADD, MASK_BOOL, cast, dropout_keep,
                                                 fp32, in_band, key_ranges, keys_kept, load_mask_tile, mma, tanh,
                                                 to_bf16)


@triton.jit
def _scores(q, kT, lse, scale, softcap, EMU: tl.constexpr, SOFTCAP: tl.constexpr, INTERP: tl.constexpr,
            mv=0.0, MASK_KIND: tl.constexpr = 0):
    """(P, slope) for a (rows, cols) tile: P = exp(S − L), lse broadcast along cols (natural units);
    with SOFTCAP, S = softcap·tanh(QKᵀ·scale/softcap) (rounded as the forward rounds it) and slope
    = dS/d(QKᵀ·scale) = 1 − (S/softcap)², which dS carries; otherwise slope = 1. MASK_KIND: the
    attn_mask tile ``mv`` added to S after the cap (ADD, in bf16 under EMU as the forward), or
    where it is False, P = 0 (BOOL).

    Scores in fp32 with nothing between the product and the exponential (no EMU, cap or additive
    mask) take log2 e into the scale and into L, which is per row: P = exp2(QKᵀ·(scale·log2 e) −
    L·log2 e), one FMA per score before the exponential instead of an FMA and a multiply."""
    if not EMU and not SOFTCAP and MASK_KIND != MASK_ADD:
        p = tl.exp2(mma(q, kT, INTERP) * (scale * 1.4426950408889634) - lse * 1.4426950408889634)
        if MASK_KIND == MASK_BOOL:
            p = tl.where(mv, p, 0.0)
        return p, 1.0
    s = mma(q, kT, INTERP) * scale
    if EMU:
        s = to_bf16(s, INTERP)
    slope = 1.0
    if SOFTCAP:
        s = softcap * tanh(s * (1.0 / softcap), not EMU and not INTERP)   # as the forward computed it
        if EMU:
            s = to_bf16(s, INTERP)
        t = s * (1.0 / softcap)
        slope = 1.0 - t * t
    if MASK_KIND == MASK_ADD:
        s = s + mv
        if EMU:
            s = to_bf16(s, INTERP)
    p = tl.exp2((s - lse) * 1.4426950408889634)
    if MASK_KIND == MASK_BOOL:
        p = tl.where(mv, p, 0.0)
    return p, slope


@triton.jit
def _safe_lse(lse, SAFE: tl.constexpr):
    """L of a row that saw no key is −inf; +inf instead makes its P = exp(S − L) zero (no NaN)."""
    if SAFE:
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
    return lse


@triton.jit
def _sequence(bh, n_heads, n_q, n_k, CU_Q, CU_K, VARLEN: tl.constexpr):
    """(b, h, row0, q_start, k_start, n_q, n_k) of program axis ``bh``: batch element (or, VARLEN,
    sequence) and head, the first LSE/δ row of this head and sequence, where the sequence starts
    among the queries and keys (0 without VARLEN), and its lengths. VARLEN gives b = 0 (one
    packed batch element) and n_q, n_k the totals."""
    b, h = bh // n_heads, bh % n_heads
    if VARLEN:
        q_start = tl.load(CU_Q + b)
        k_start = tl.load(CU_K + b)
        row0 = h * n_q + q_start
        n_q = tl.load(CU_Q + b + 1) - q_start
        n_k = tl.load(CU_K + b + 1) - k_start
        b = b * 0
    else:
        q_start = 0
        k_start = 0
        row0 = bh * n_q
    return b, h, row0, q_start, k_start, n_q, n_k


@triton.jit
def _query_program(n_heads, n_q, n_k, CU_Q, CU_K, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr):
    """(start_m, bh, b, h, row0, q_start, k_start, n_q, n_k) of a query-block program (the δ pass
    and dQ): its first row, longest blocks first, its batch element (or sequence)·head ``bh`` (the
    dropout counter), and ``_sequence``'s place of it. VARLEN puts sequence·head on the grid's
    first axis (``op.varlen_grid``)."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    if VARLEN:
        start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
        bh = tl.program_id(0)
    b, h, row0, q_start, k_start, n_q, n_k = _sequence(bh, n_heads, n_q, n_k, CU_Q, CU_K, VARLEN)
    return start_m, bh, b, h, row0, q_start, k_start, n_q, n_k


@triton.jit
def delta_dot_kernel(O, R, DO, DELTA, stride_ob, stride_oh, stride_om, stride_db, stride_dh, stride_dm,
                     n_heads, n_q, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_R: tl.constexpr,
                     ZERO=0, stride_zb=0, stride_zh=0, stride_zm=0, stride_zd=0, CLEAR: tl.constexpr = False):
    """δ = rowsum(dO ∘ O) in fp32; with HAS_R, rowsum(dO ∘ (O + R)), R the O store's rounding
    residual (contiguous (B, H, Nq, d), as the forward wrote it), added here in fp32. CLEAR: also
    zeros of ZERO's rows of the block, a (B, H, Nq, d) fp32 tensor with the given strides (the buffer
    a backward adds dQ up in), so that clearing it costs no launch of its own."""
    bh = tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None] < n_q
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :], mask=rows, other=0.0)
    o = o.to(tl.float32)
    if HAS_R:
        o += tl.load(R + (bh * n_q + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], mask=rows, other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_db + h * stride_dh + offs_m[:, None] * stride_dm + offs_d[None, :], mask=rows, other=0.0)
    tl.store(DELTA + bh * n_q + offs_m, tl.sum(o * do.to(tl.float32), 1), mask=offs_m < n_q)
    if CLEAR:
        tl.store(ZERO + b * stride_zb + h * stride_zh + offs_m[:, None] * stride_zm + offs_d[None, :] * stride_zd,
                 tl.zeros([BLOCK_M, HEAD_DIM], tl.float32), mask=rows)


@triton.jit
def delta_pass_kernel(Q, K, V, DO, LSE, DELTA,
                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm,
                      n_heads, group, n_q, n_k, scale, softcap,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL: tl.constexpr, DELTA_SRC: tl.constexpr, EMU: tl.constexpr, SOFTCAP: tl.constexpr,
                      INTERP: tl.constexpr,
                      CU_Q=0, CU_K=0, MASK=0, stride_mb=0, stride_mh=0, stride_mm=0, stride_mn=0,
                      left=0, right=0, align_br=0, drop_seed=0, drop_thr=0, drop_scale=1.0,
                      BAND: tl.constexpr = False, VARLEN: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
                      MASK_ROWS: tl.constexpr = False, DROPOUT: tl.constexpr = False):
    """δ from dP·P (DELTA_SRC = DELTA_DP_P) or from dO·(PV in fp32) (DELTA_RECOMPUTE): one pass over the
    keys, longest query blocks first (as in the forward). The masking switches as the forward's;
    with DROPOUT, dP and PV those of the dropped, rescaled P."""
    scale, softcap, drop_scale = fp32(scale), fp32(softcap), fp32(drop_scale)
    if BAND or VARLEN or MASK_KIND != 0 or DROPOUT:
        _delta_pass_masked(Q, K, V, DO, LSE, DELTA, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                           stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm,
                           n_heads, group, n_q, n_k, scale, softcap, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, DELTA_SRC,
                           EMU, SOFTCAP, INTERP, CU_Q, CU_K, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                           left, right, align_br, drop_seed, drop_thr, drop_scale,
                           BAND, VARLEN, MASK_KIND, MASK_ROWS, DROPOUT)
    else:
        _delta_pass(Q, K, V, DO, LSE, DELTA, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm,
                    n_heads, group, n_q, n_k, scale, softcap, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, DELTA_SRC,
                    EMU, SOFTCAP, INTERP)


@triton.jit
def _delta_pass(Q, K, V, DO, LSE, DELTA, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm,
                n_heads, group, n_q, n_k, scale, softcap,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, DELTA_SRC: tl.constexpr, EMU: tl.constexpr, SOFTCAP: tl.constexpr,
                INTERP: tl.constexpr):
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    hk = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None] < n_q
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :], mask=rows, other=0.0)
    do = tl.load(DO + b * stride_db + h * stride_dh + offs_m[:, None] * stride_dm + offs_d[None, :], mask=rows, other=0.0)
    lse = tl.load(LSE + bh * n_q + offs_m, mask=offs_m < n_q, other=0.0)
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    delta = tl.zeros([BLOCK_M], tl.float32)
    o_hp = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    stop = tl.minimum(n_k, start_m + BLOCK_M) if CAUSAL else n_k
    for start_n in range(0, stop, BLOCK_N):
        cols = start_n + offs_n
        kT = tl.load(K + cols[None, :] * stride_kn + offs_d[:, None], mask=cols[None, :] < n_k, other=0.0)
        v = tl.load(V + cols[:, None] * stride_vn + offs_d[None, :], mask=cols[:, None] < n_k, other=0.0)
        p, _ = _scores(q, kT, lse[:, None], scale, softcap, EMU, SOFTCAP, INTERP)
        keep = keys_kept(offs_m, cols, n_k, CAUSAL)
        p = tl.where(keep, p, 0.0)
        if DELTA_SRC == DELTA_DP_P:
            dp = mma(do, tl.trans(v), INTERP)
            delta += tl.sum(p * dp, 1)
        else:
            o_hp += tl.dot(p, v.to(tl.float32), input_precision="ieee")
    if DELTA_SRC == DELTA_RECOMPUTE:
        delta = tl.sum(o_hp * do.to(tl.float32), 1)
    tl.store(DELTA + bh * n_q + offs_m, delta, mask=offs_m < n_q)


@triton.jit
def _delta_pass_masked(Q, K, V, DO, LSE, DELTA, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                       stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm,
                       n_heads, group, n_q, n_k, scale, softcap,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, DELTA_SRC: tl.constexpr, EMU: tl.constexpr, SOFTCAP: tl.constexpr,
                       INTERP: tl.constexpr, CU_Q, CU_K, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                       left, right, align_br, drop_seed, drop_thr, drop_scale,
                       BAND: tl.constexpr, VARLEN: tl.constexpr, MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr,
                       DROPOUT: tl.constexpr):
    start_m, bh, b, h, row0, q_start, k_start, n_q, n_k = _query_program(n_heads, n_q, n_k, CU_Q, CU_K, BLOCK_M,
                                                                          VARLEN)
    hk = h // group
    if VARLEN:
        Q += q_start.to(tl.int64) * stride_qm
        DO += q_start.to(tl.int64) * stride_dm
        K += k_start.to(tl.int64) * stride_kn
        V += k_start.to(tl.int64) * stride_vn
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None] < n_q
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :], mask=rows, other=0.0)
    do = tl.load(DO + b * stride_db + h * stride_dh + offs_m[:, None] * stride_dm + offs_d[None, :], mask=rows, other=0.0)
    lse = _safe_lse(tl.load(LSE + row0 + offs_m, mask=offs_m < n_q, other=0.0), True)
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    MP = MASK
    if MASK_KIND != 0:
        MP = MASK + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    diag = align_br * (n_k - n_q)
    if BAND:
        k_lo, _mid_lo, _mid_hi, k_hi = key_ranges(start_m, n_q, n_k, diag - left, diag + right, BLOCK_M, BLOCK_N)
    else:
        k_lo = 0
        k_hi = tl.minimum(n_k, start_m + BLOCK_M) if CAUSAL else n_k
        k_hi = tl.where(start_m < n_q, k_hi, 0)
    delta = tl.zeros([BLOCK_M], tl.float32)
    o_hp = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(k_lo, k_hi, BLOCK_N):
        cols = start_n + offs_n
        kT = tl.load(K + cols[None, :] * stride_kn + offs_d[:, None], mask=cols[None, :] < n_k, other=0.0)
        v = tl.load(V + cols[:, None] * stride_vn + offs_d[None, :], mask=cols[:, None] < n_k, other=0.0)
        mv = 0.0
        if MASK_KIND != 0:
            mv = load_mask_tile(MP, offs_m, cols, n_q, n_k, stride_mm, stride_mn, MASK_KIND, MASK_ROWS)
        p, _ = _scores(q, kT, lse[:, None], scale, softcap, EMU, SOFTCAP, INTERP, mv, MASK_KIND)
        keep = keys_kept(offs_m, cols, n_k, CAUSAL)
        if BAND:
            keep = keep & in_band(offs_m[:, None], cols[None, :], diag, left, right)
        if DROPOUT:
            keep = keep & dropout_keep(drop_seed, drop_thr, offs_m[:, None], cols[None, :], bh)
        p = tl.where(keep, p, 0.0)
        if DELTA_SRC == DELTA_DP_P:
            dp = mma(do, tl.trans(v), INTERP)
            delta += tl.sum(p * dp, 1)
        else:
            o_hp += tl.dot(p, v.to(tl.float32), input_precision="ieee")
    if DELTA_SRC == DELTA_RECOMPUTE:
        delta = tl.sum(o_hp * do.to(tl.float32), 1)
    if DROPOUT:
        delta = delta * drop_scale
    tl.store(DELTA + row0 + offs_m, delta, mask=offs_m < n_q)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qm, stride_dm, offs_n, offs_d, start, stop,
                 n_q, scale, softcap, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                 EMU: tl.constexpr, SOFTCAP: tl.constexpr, INTERP: tl.constexpr,
                 n_k=0, diag=0, left=0, right=0, MP=0, stride_mm=0, stride_mn=0, drop_seed=0, drop_thr=0,
                 drop_scale=1.0, drop_bh=0, BAND: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
                 MASK_ROWS: tl.constexpr = False, DROPOUT: tl.constexpr = False, SAFE: tl.constexpr = False):
    """Lines 10-21 of Algorithm 2 for query blocks [start, stop), transposed (keys as rows). The
    masking switches as in the forward's ``_fwd_blocks``; SAFE: rows with L = −inf get P = 0;
    DROPOUT: dV from the dropped P (its 1/(1 − p) applied by the caller), dP dropped and rescaled."""
    offs_m = tl.arange(0, BLOCK_M)
    for start_m in range(start, stop, BLOCK_M):
        rows = start_m + offs_m
        if MASKED:
            qT = tl.load(Q + rows[None, :] * stride_qm + offs_d[:, None], mask=rows[None, :] < n_q, other=0.0)
            do = tl.load(DO + rows[:, None] * stride_dm + offs_d[None, :], mask=rows[:, None] < n_q, other=0.0)
            lse = tl.load(LSE + rows, mask=rows < n_q, other=0.0)
            delta = tl.load(DELTA + rows, mask=rows < n_q, other=0.0)
        else:
            qT = tl.load(Q + rows[None, :] * stride_qm + offs_d[:, None])
            do = tl.load(DO + rows[:, None] * stride_dm + offs_d[None, :])
            lse = tl.load(LSE + rows)
            delta = tl.load(DELTA + rows)
        mv = 0.0
        if MASK_KIND != 0:
            mv = tl.trans(load_mask_tile(MP, rows, offs_n, n_q, n_k, stride_mm, stride_mn, MASK_KIND, MASK_ROWS))
        pT, slopeT = _scores(k, qT, _safe_lse(lse, SAFE)[None, :], scale, softcap, EMU, SOFTCAP, INTERP,
                             mv, MASK_KIND)   # (BLOCK_N, BLOCK_M)
        if MASKED:
            keep = rows[None, :] < n_q
            if CAUSAL:
                keep = keep & (offs_n[:, None] <= rows[None, :])
            if BAND:
                keep = keep & in_band(rows[None, :], offs_n[:, None], diag, left, right)
            pT = tl.where(keep, pT, 0.0)
        if DROPOUT:
            kept = dropout_keep(drop_seed, drop_thr, rows[None, :], offs_n[:, None], drop_bh)
            dv += mma(cast(tl.where(kept, pT, 0.0), do.dtype, INTERP), do, INTERP)
            dpT = mma(v, tl.trans(do), INTERP)
            dpT = tl.where(kept, dpT * drop_scale, 0.0)
        else:
            dv += mma(cast(pT, do.dtype, INTERP), do, INTERP)
            dpT = mma(v, tl.trans(do), INTERP)
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:
            dsT = dsT * slopeT
        dk += mma(cast(dsT, qT.dtype, INTERP), tl.trans(qT), INTERP)
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                         stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                         stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm,
                         stride_dkb, stride_dkh, stride_dkn,
                         n_heads, group, n_q, n_k, scale, softcap,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr, EMU: tl.constexpr, SOFTCAP: tl.constexpr, INTERP: tl.constexpr,
                         CU_Q=0, CU_K=0, MASK=0, stride_mb=0, stride_mh=0, stride_mm=0, stride_mn=0,
                         left=0, right=0, align_br=0, drop_seed=0, drop_thr=0, drop_scale=1.0,
                         BAND: tl.constexpr = False, VARLEN: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
                         MASK_ROWS: tl.constexpr = False, DROPOUT: tl.constexpr = False,
                         dk_offset=0, dv_offset=0, DV_IN_DK: tl.constexpr = False):
    """dK, dV of one key block of one (batch, kv head), over the query heads of its group. With the
    masking switches (as the forward's), the query blocks that see the key block: a masked leading
    edge, whole unmasked blocks, a masked trailing edge (the band read from the keys' side).
    ``DV_IN_DK``: DK is one packed gradient of q, k and v, with dK at element ``dk_offset`` and dV
    at ``dv_offset`` (strides ``stride_dk*`` for both); DV is not read."""
    scale, softcap, drop_scale = fp32(scale), fp32(softcap), fp32(drop_scale)
    if DV_IN_DK:
        DV = DK + dv_offset
        DK = DK + dk_offset
    if BAND or VARLEN or MASK_KIND != 0 or DROPOUT:
        _dkdv_masked(Q, K, V, DO, LSE, DELTA, DK, DV, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm, stride_dkb, stride_dkh,
                     stride_dkn, n_heads, group, n_q, n_k, scale, softcap, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, EMU,
                     SOFTCAP, INTERP, CU_Q, CU_K, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                     left, right, align_br, drop_seed, drop_thr, drop_scale, BAND, VARLEN, MASK_KIND, MASK_ROWS,
                     DROPOUT)
    else:
        start_n = tl.program_id(0) * BLOCK_N
        bhk = tl.program_id(1)
        n_kv_heads = n_heads // group
        b, hk = bhk // n_kv_heads, bhk % n_kv_heads
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        cols = offs_n[:, None] < n_k
        k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :], mask=cols, other=0.0)
        v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :], mask=cols, other=0.0)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        # queries [start, diag_end) see part of this key block (causal); [diag_end, full) all of it;
        # [full, n_q) is the ragged tail
        start = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
        full = (n_q // BLOCK_M) * BLOCK_M
        diag_end = tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M, full) if CAUSAL else start
        diag_end = tl.maximum(diag_end, start)
        for g in range(0, group):
            h = hk * group + g
            q_ptr = Q + b * stride_qb + h * stride_qh
            do_ptr = DO + b * stride_db + h * stride_dh
            lse_ptr = LSE + (b * n_heads + h) * n_q
            delta_ptr = DELTA + (b * n_heads + h) * n_q
            dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qm, stride_dm,
                                  offs_n, offs_d, start, diag_end, n_q, scale, softcap, BLOCK_M, CAUSAL, True, EMU, SOFTCAP, INTERP)
            dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qm, stride_dm,
                                  offs_n, offs_d, diag_end, full, n_q, scale, softcap, BLOCK_M, CAUSAL, False, EMU, SOFTCAP, INTERP)
            dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qm, stride_dm,
                                  offs_n, offs_d, tl.maximum(full, diag_end), n_q, n_q, scale, softcap, BLOCK_M,
                                  CAUSAL, True, EMU, SOFTCAP, INTERP)
        out = b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
        tl.store(DK + out, cast(dk * scale, DK.dtype.element_ty, INTERP), mask=cols)
        tl.store(DV + out, cast(dv, DV.dtype.element_ty, INTERP), mask=cols)


@triton.jit
def _dkdv_masked(Q, K, V, DO, LSE, DELTA, DK, DV, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm, stride_dkb, stride_dkh, stride_dkn,
                 n_heads, group, n_q, n_k, scale, softcap,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, EMU: tl.constexpr, SOFTCAP: tl.constexpr, INTERP: tl.constexpr,
                 CU_Q, CU_K, MASK, stride_mb, stride_mh, stride_mm, stride_mn,
                 left, right, align_br, drop_seed, drop_thr, drop_scale,
                 BAND: tl.constexpr, VARLEN: tl.constexpr, MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr,
                 DROPOUT: tl.constexpr):
    SAFE: tl.constexpr = BAND or VARLEN or MASK_KIND != 0
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    if VARLEN:                                 # sequence·kv head on the first axis (``varlen_grid``)
        start_n = tl.program_id(1) * BLOCK_N
        bhk = tl.program_id(0)
    n_kv_heads = n_heads // group
    b, hk = bhk // n_kv_heads, bhk % n_kv_heads
    seq = b                                    # the batch element, or (VARLEN) the sequence
    total_q = n_q
    if VARLEN:
        q_start = tl.load(CU_Q + b)
        k_start = tl.load(CU_K + b)
        n_q = tl.load(CU_Q + b + 1) - q_start
        n_k = tl.load(CU_K + b + 1) - k_start
        b = b * 0
        Q += q_start.to(tl.int64) * stride_qm
        DO += q_start.to(tl.int64) * stride_dm
        K += k_start.to(tl.int64) * stride_kn
        V += k_start.to(tl.int64) * stride_vn
        DK += k_start.to(tl.int64) * stride_dkn
        DV += k_start.to(tl.int64) * stride_dkn
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    cols = offs_n[:, None] < n_k
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :], mask=cols, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :], mask=cols, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    diag = align_br * (n_k - n_q)
    if BAND:          # query i sees key j when j − diag − right ≤ i ≤ j − diag + left
        q_lo, mid_lo, mid_hi, q_hi = key_ranges(start_n, n_k, n_q, -diag - right, -diag + left, BLOCK_N, BLOCK_M)
    else:             # the kernel's own ranges (CAUSAL: top-left)
        q_lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
        full = (n_q // BLOCK_M) * BLOCK_M
        mid_lo = tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M, full) if CAUSAL else q_lo
        mid_lo = tl.maximum(mid_lo, q_lo)
        mid_hi = tl.maximum(full, mid_lo)
        q_hi = n_q
    for g in range(0, group):
        h = hk * group + g
        if VARLEN:
            row0 = h * total_q + q_start
        else:
            row0 = (b * n_heads + h) * n_q
        q_ptr = Q + b * stride_qb + h * stride_qh
        do_ptr = DO + b * stride_db + h * stride_dh
        lse_ptr = LSE + row0
        delta_ptr = DELTA + row0
        MP = MASK
        if MASK_KIND != 0:
            MP = MASK + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
        bh = seq * n_heads + h
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qm, stride_dm,
                              offs_n, offs_d, q_lo, mid_lo, n_q, scale, softcap, BLOCK_M, CAUSAL, True, EMU, SOFTCAP,
                              INTERP, n_k, diag, left, right, MP, stride_mm, stride_mn, drop_seed, drop_thr,
                              drop_scale, bh, BAND, MASK_KIND, MASK_ROWS, DROPOUT, SAFE)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qm, stride_dm,
                              offs_n, offs_d, mid_lo, mid_hi, n_q, scale, softcap, BLOCK_M, CAUSAL, False, EMU, SOFTCAP,
                              INTERP, n_k, diag, left, right, MP, stride_mm, stride_mn, drop_seed, drop_thr,
                              drop_scale, bh, BAND, MASK_KIND, MASK_ROWS, DROPOUT, MASK_KIND != 0)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qm, stride_dm,
                              offs_n, offs_d, mid_hi, q_hi, n_q, scale, softcap, BLOCK_M, CAUSAL, True, EMU, SOFTCAP,
                              INTERP, n_k, diag, left, right, MP, stride_mm, stride_mn, drop_seed, drop_thr,
                              drop_scale, bh, BAND, MASK_KIND, MASK_ROWS, DROPOUT, SAFE)
    if DROPOUT:
        dv = dv * drop_scale
    out = b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
    tl.store(DK + out, cast(dk * scale, DK.dtype.element_ty, INTERP), mask=cols)
    tl.store(DV + out, cast(dv, DV.dtype.element_ty, INTERP), mask=cols)


@triton.jit
def _dq_blocks(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, offs_m, offs_d, start, stop, n_k,
               scale, softcap, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
               EMU: tl.constexpr, SOFTCAP: tl.constexpr, INTERP: tl.constexpr,
               n_q=0, diag=0, left=0, right=0, MP=0, stride_mm=0, stride_mn=0, drop_seed=0, drop_thr=0,
               drop_scale=1.0, drop_bh=0, BAND: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
               MASK_ROWS: tl.constexpr = False, DROPOUT: tl.constexpr = False):
    """dQ over key blocks [start, stop); the masking switches as in ``_dkdv_blocks`` (``lse``
    already made safe by the caller)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, stop, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            kT = tl.load(K + cols[None, :] * stride_kn + offs_d[:, None], mask=cols[None, :] < n_k, other=0.0)
            vT = tl.load(V + cols[None, :] * stride_vn + offs_d[:, None], mask=cols[None, :] < n_k, other=0.0)
        else:
            kT = tl.load(K + cols[None, :] * stride_kn + offs_d[:, None])
            vT = tl.load(V + cols[None, :] * stride_vn + offs_d[:, None])
        mv = 0.0
        if MASK_KIND != 0:
            mv = load_mask_tile(MP, offs_m, cols, n_q, n_k, stride_mm, stride_mn, MASK_KIND, MASK_ROWS)
        p, slope = _scores(q, kT, lse[:, None], scale, softcap, EMU, SOFTCAP, INTERP, mv, MASK_KIND)
        if MASKED:
            keep = keys_kept(offs_m, cols, n_k, CAUSAL)
            if BAND:
                keep = keep & in_band(offs_m[:, None], cols[None, :], diag, left, right)
            p = tl.where(keep, p, 0.0)
        dp = mma(do, vT, INTERP)
        if DROPOUT:
            dp = tl.where(dropout_keep(drop_seed, drop_thr, offs_m[:, None], cols[None, :], drop_bh),
                          dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * slope
        dq += mma(cast(ds, kT.dtype, INTERP), tl.trans(kT), INTERP)
    return dq


@triton.jit
def attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
                       stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                       stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm,
                       stride_dqb, stride_dqh, stride_dqm,
                       n_heads, group, n_q, n_k, scale, softcap,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, EMU: tl.constexpr, SOFTCAP: tl.constexpr, INTERP: tl.constexpr,
                       CU_Q=0, CU_K=0, MASK=0, stride_mb=0, stride_mh=0, stride_mm=0, stride_mn=0,
                       left=0, right=0, align_br=0, drop_seed=0, drop_thr=0, drop_scale=1.0,
                       BAND: tl.constexpr = False, VARLEN: tl.constexpr = False, MASK_KIND: tl.constexpr = 0,
                       MASK_ROWS: tl.constexpr = False, DROPOUT: tl.constexpr = False,
                       O=0, R=0, stride_ob=0, stride_oh=0, stride_om=0,
                       FUSE_DELTA: tl.constexpr = False, HAS_R: tl.constexpr = False):
    """dQ of one query block of one (batch, head); the masking switches as the forward's. FUSE_DELTA
    (no masking switch on): δ of the block's rows computed here as ``delta_dot_kernel`` computes it,
    rowsum(dO ∘ O) or with HAS_R rowsum(dO ∘ (O + R)), from the dO tile this kernel loads anyway,
    and stored to DELTA for the dK/dV kernel launched after it (one kernel and one read of dO fewer)."""
    scale, softcap, drop_scale = fp32(scale), fp32(softcap), fp32(drop_scale)
    if BAND or VARLEN or MASK_KIND != 0 or DROPOUT:
        _dq_masked(Q, K, V, DO, LSE, DELTA, DQ, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm, stride_dqb, stride_dqh, stride_dqm,
                   n_heads, group, n_q, n_k, scale, softcap, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, EMU, SOFTCAP, INTERP,
                   CU_Q, CU_K, MASK, stride_mb, stride_mh, stride_mm, stride_mn, left, right, align_br,
                   drop_seed, drop_thr, drop_scale, BAND, VARLEN, MASK_KIND, MASK_ROWS, DROPOUT)
    else:
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M     # longest first, as in the forward
        bh = tl.program_id(1)
        b, h = bh // n_heads, bh % n_heads
        hk = h // group
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        rows = offs_m[:, None] < n_q
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :], mask=rows, other=0.0)
        do = tl.load(DO + b * stride_db + h * stride_dh + offs_m[:, None] * stride_dm + offs_d[None, :], mask=rows, other=0.0)
        lse = tl.load(LSE + bh * n_q + offs_m, mask=offs_m < n_q, other=0.0)
        if FUSE_DELTA:
            o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :], mask=rows,
                        other=0.0).to(tl.float32)
            if HAS_R:
                o += tl.load(R + (bh * n_q + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], mask=rows,
                             other=0.0).to(tl.float32)
            delta = tl.sum(o * do.to(tl.float32), 1)
            tl.store(DELTA + bh * n_q + offs_m, delta, mask=offs_m < n_q)
        else:
            delta = tl.load(DELTA + bh * n_q + offs_m, mask=offs_m < n_q, other=0.0)
        K += b * stride_kb + hk * stride_kh
        V += b * stride_vb + hk * stride_vh
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        stop = tl.minimum(n_k, start_m + BLOCK_M) if CAUSAL else n_k
        full = (n_k // BLOCK_N) * BLOCK_N
        if CAUSAL:
            full = tl.minimum(full, (start_m // BLOCK_N) * BLOCK_N)
        dq = _dq_blocks(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, offs_m, offs_d, 0, full, n_k, scale,
                        softcap, BLOCK_N, CAUSAL, False, EMU, SOFTCAP, INTERP)
        dq = _dq_blocks(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, offs_m, offs_d, full, stop, n_k, scale,
                        softcap, BLOCK_N, CAUSAL, True, EMU, SOFTCAP, INTERP)
        out = b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :]
        tl.store(DQ + out, cast(dq * scale, DQ.dtype.element_ty, INTERP), mask=rows)


@triton.jit
def _dq_masked(Q, K, V, DO, LSE, DELTA, DQ, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
               stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm, stride_dqb, stride_dqh, stride_dqm,
               n_heads, group, n_q, n_k, scale, softcap,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, EMU: tl.constexpr, SOFTCAP: tl.constexpr, INTERP: tl.constexpr,
               CU_Q, CU_K, MASK, stride_mb, stride_mh, stride_mm, stride_mn, left, right, align_br,
               drop_seed, drop_thr, drop_scale,
               BAND: tl.constexpr, VARLEN: tl.constexpr, MASK_KIND: tl.constexpr, MASK_ROWS: tl.constexpr,
               DROPOUT: tl.constexpr):
    SAFE: tl.constexpr = BAND or VARLEN or MASK_KIND != 0
    start_m, bh, b, h, row0, q_start, k_start, n_q, n_k = _query_program(n_heads, n_q, n_k, CU_Q, CU_K, BLOCK_M,
                                                                          VARLEN)
    hk = h // group
    if VARLEN:
        Q += q_start.to(tl.int64) * stride_qm
        DO += q_start.to(tl.int64) * stride_dm
        DQ += q_start.to(tl.int64) * stride_dqm
        K += k_start.to(tl.int64) * stride_kn
        V += k_start.to(tl.int64) * stride_vn
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None] < n_q
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :], mask=rows, other=0.0)
    do = tl.load(DO + b * stride_db + h * stride_dh + offs_m[:, None] * stride_dm + offs_d[None, :], mask=rows, other=0.0)
    lse = _safe_lse(tl.load(LSE + row0 + offs_m, mask=offs_m < n_q, other=0.0), SAFE)
    delta = tl.load(DELTA + row0 + offs_m, mask=offs_m < n_q, other=0.0)
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    MP = MASK
    if MASK_KIND != 0:
        MP = MASK + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    diag = align_br * (n_k - n_q)
    if BAND:
        k_lo, mid_lo, mid_hi, k_hi = key_ranges(start_m, n_q, n_k, diag - left, diag + right, BLOCK_M, BLOCK_N)
    else:
        k_lo = 0
        k_hi = tl.minimum(n_k, start_m + BLOCK_M) if CAUSAL else n_k
        mid_lo = 0
        mid_hi = (n_k // BLOCK_N) * BLOCK_N
        if CAUSAL:
            mid_hi = tl.minimum(mid_hi, (start_m // BLOCK_N) * BLOCK_N)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    dq = _dq_blocks(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, offs_m, offs_d, k_lo, mid_lo, n_k, scale,
                    softcap, BLOCK_N, CAUSAL, True, EMU, SOFTCAP, INTERP, n_q, diag, left, right, MP, stride_mm,
                    stride_mn, drop_seed, drop_thr, drop_scale, bh, BAND, MASK_KIND, MASK_ROWS, DROPOUT)
    dq = _dq_blocks(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, offs_m, offs_d, mid_lo, mid_hi, n_k, scale,
                    softcap, BLOCK_N, CAUSAL, False, EMU, SOFTCAP, INTERP, n_q, diag, left, right, MP, stride_mm,
                    stride_mn, drop_seed, drop_thr, drop_scale, bh, BAND, MASK_KIND, MASK_ROWS, DROPOUT)
    dq = _dq_blocks(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, offs_m, offs_d, mid_hi, k_hi, n_k, scale,
                    softcap, BLOCK_N, CAUSAL, True, EMU, SOFTCAP, INTERP, n_q, diag, left, right, MP, stride_mm,
                    stride_mn, drop_seed, drop_thr, drop_scale, bh, BAND, MASK_KIND, MASK_ROWS, DROPOUT)
    out = b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :]
    tl.store(DQ + out, cast(dq * scale, DQ.dtype.element_ty, INTERP), mask=rows)
