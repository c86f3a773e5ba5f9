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

from stableflash.attention.triton.common import DELTA_DP_P, DELTA_RECOMPUTE, cast, mma, tanh, to_bf16


@triton.jit
def _scores(q, kT, lse, scale, softcap, EMU: tl.constexpr, SOFTCAP: tl.constexpr, INTERP: tl.constexpr):
    """(P, slope) for a (rows, cols) tile: P = exp(S − L), lse broadcast along cols (natural units);
    with SOFTCAP, S = softcap·tanh(QKᵀ·scale/softcap) (rounded as the forward rounds it) and slope
    = dS/d(QKᵀ·scale) = 1 − (S/softcap)², which dS carries; otherwise slope = 1."""
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
    return tl.exp2((s - lse) * 1.4426950408889634), slope


@triton.jit
def delta_dot_kernel(O, R, DO, DELTA, stride_ob, stride_oh, stride_om, stride_db, stride_dh, stride_dm,
                     n_heads, n_q, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_R: tl.constexpr):
    """δ = rowsum(dO ∘ O) in fp32; with HAS_R, rowsum(dO ∘ (O + R)), R the O store's rounding
    residual (contiguous (B, H, Nq, d), as the forward wrote it), added here in fp32."""
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


@triton.jit
def delta_pass_kernel(Q, K, V, DO, LSE, DELTA,
                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm,
                      n_heads, group, n_q, n_k, scale, softcap,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL: tl.constexpr, DELTA_SRC: tl.constexpr, EMU: tl.constexpr, SOFTCAP: tl.constexpr,
                      INTERP: tl.constexpr):
    """δ from dP·P (DELTA_SRC = DELTA_DP_P) or from dO·(PV in fp32) (DELTA_RECOMPUTE): one pass over the
    keys, longest query blocks first (as in the forward)."""
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
        keep = cols[None, :] < n_k
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
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
def _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qm, stride_dm, offs_n, offs_d, start, stop,
                 n_q, scale, softcap, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                 EMU: tl.constexpr, SOFTCAP: tl.constexpr, INTERP: tl.constexpr):
    """Lines 10-21 of Algorithm 2 for query blocks [start, stop), transposed (keys as rows)."""
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
        pT, slopeT = _scores(k, qT, lse[None, :], scale, softcap, EMU, SOFTCAP, INTERP)   # (BLOCK_N, BLOCK_M)
        if MASKED:
            keep = rows[None, :] < n_q
            if CAUSAL:
                keep = keep & (offs_n[:, None] <= rows[None, :])
            pT = tl.where(keep, pT, 0.0)
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
                         CAUSAL: tl.constexpr, EMU: tl.constexpr, SOFTCAP: tl.constexpr, INTERP: tl.constexpr):
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
def _dq_blocks(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, offs_m, offs_d, start, stop, n_k,
               scale, softcap, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
               EMU: tl.constexpr, SOFTCAP: tl.constexpr, INTERP: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, stop, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            kT = tl.load(K + cols[None, :] * stride_kn + offs_d[:, None], mask=cols[None, :] < n_k, other=0.0)
            vT = tl.load(V + cols[None, :] * stride_vn + offs_d[:, None], mask=cols[None, :] < n_k, other=0.0)
        else:
            kT = tl.load(K + cols[None, :] * stride_kn + offs_d[:, None])
            vT = tl.load(V + cols[None, :] * stride_vn + offs_d[:, None])
        p, slope = _scores(q, kT, lse[:, None], scale, softcap, EMU, SOFTCAP, INTERP)
        if MASKED:
            keep = cols[None, :] < n_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            p = tl.where(keep, p, 0.0)
        dp = mma(do, vT, INTERP)
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
                       CAUSAL: tl.constexpr, EMU: tl.constexpr, SOFTCAP: tl.constexpr, INTERP: tl.constexpr):
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
