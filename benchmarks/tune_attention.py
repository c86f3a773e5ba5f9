"""Fixed-config timings of the Triton kernels, to choose tile configs and measure rule overheads.

Forward: each config × rule (standard, paper, ours, bounded). Backward (unless FWD_ONLY=1): the
dK/dV and dQ kernels per config. Medians of do_bench; the best of each is printed last. JSON
under $OUT."""
import json
import math
import os

import torch
import triton
import triton.testing

from stableflash.attention.triton import backward as bw
from stableflash.attention.triton import op
from stableflash.attention.triton.forward import attn_fwd_kernel

SHAPES = [(32, 12, 1024, 64), (8, 16, 4096, 64), (4, 16, 8192, 128)]
FWD = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3)]
DKDV = [(32, 128, 4, 3), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 2),
        (32, 128, 4, 4)]
DQ = [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 3), (128, 64, 8, 2),
      (128, 32, 4, 4)]
LOG2E = 1 / math.log(2)
dev = "cuda"
RULES = (0, 1, 2, 3)        # standard, paper, ours, bounded
rows = []


def bench(fn):
    try:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    except Exception as exc:  # out of resources and the like
        return float("nan")


for shape in SHAPES:
    B, H, N, D = shape
    q, k, v, do = (torch.randn(*shape, device=dev, dtype=torch.bfloat16) for _ in range(4))
    o = torch.empty_like(q)
    lse = torch.empty(B, H, N, device=dev, dtype=torch.float32)
    st = lambda t: (t.stride(0), t.stride(1), t.stride(2))  # noqa: E731
    scale = D ** -0.5
    for bm, bn, w, s in FWD:
        for stab in RULES:
            def fwd():
                attn_fwd_kernel[(triton.cdiv(N, bm), B * H)](
                    q, k, v, o, lse, *st(q), *st(k), *st(v), *st(o), H, 1, N, N, scale * LOG2E, 2.0, 1e-3 * LOG2E,
                    0.13 * LOG2E, 8.4 * LOG2E, 1.0, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=True, STAB=stab,
                    EMU=False, INTERP=False, num_warps=w, num_stages=s)
            rows.append(dict(shape=shape, kernel="fwd", cfg=(bm, bn, w, s), stab=stab, ms=bench(fwd)))
    if os.environ.get("FWD_ONLY") == "1":
        continue
    # the backward needs a real lse and delta
    o, lse = op.attn_fwd(q, k, v, True, scale, 0, 2.0, 1e-3, 0.13, 8.4, False, 0)
    delta = (o.float() * do.float()).sum(-1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = (*st(q), *st(k), *st(v), *st(do))
    for bm, bn, w, s in DKDV:
        def dkdv():
            bw.attn_bwd_dkdv_kernel[(triton.cdiv(N, bn), B * H)](
                q, k, v, do, lse, delta, dk, dv, *common, *st(dk), H, 1, N, N, scale, HEAD_DIM=D, BLOCK_M=bm,
                BLOCK_N=bn, CAUSAL=True, EMU=False, INTERP=False, num_warps=w, num_stages=s)
        rows.append(dict(shape=shape, kernel="dkdv", cfg=(bm, bn, w, s), ms=bench(dkdv)))
    for bm, bn, w, s in DQ:
        def dq_():
            bw.attn_bwd_dq_kernel[(triton.cdiv(N, bm), B * H)](
                q, k, v, do, lse, delta, dq, *common, *st(dq), H, 1, N, N, scale, HEAD_DIM=D, BLOCK_M=bm,
                BLOCK_N=bn, CAUSAL=True, EMU=False, INTERP=False, num_warps=w, num_stages=s)
        rows.append(dict(shape=shape, kernel="dq", cfg=(bm, bn, w, s), ms=bench(dq_)))
    torch.cuda.empty_cache()

json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "tune.json"), "w"), indent=1)
for shape in SHAPES:
    B, H, N, D = shape
    f = 4 * B * H * N * N * D * 0.5
    print(shape)
    for kernel, variants in (("fwd", list(RULES)), ("dkdv", [None]), ("dq", [None])):
        for var in variants:
            cand = [r for r in rows if r["shape"] == shape and r["kernel"] == kernel and not math.isnan(r["ms"])
                    and (var is None or r["stab"] == var)]
            cand.sort(key=lambda r: r["ms"])
            if not cand:
                continue
            top = ", ".join(f"{r['cfg']}: {r['ms']:.3f} ms" for r in cand[:3])
            label = kernel if var is None else f"fwd rule={('standard', 'paper', 'ours', 'bounded')[var]}"
            tf = f * (1.0 if kernel == "fwd" else 1.0) / cand[0]["ms"] / 1e9 if cand else 0
            print(f"  {label:32s} best {top}   ({tf:.0f} fwd-equiv TFLOP/s)")
