"""Fixed-config timings of the Triton kernels, to choose tile configs and measure what each
variant gains.

Forward: each config × rule (standard, paper, tie-shift, all-shift) × key loop through pointers or
tensor descriptors (TMA) × grid (one program per tile, or persistent: P programs per SM walking
every tile longest first). Backward (unless FWD_ONLY=1): the dK/dV and dQ kernels per config.
BWD_ONLY=1 skips the forward. Env: RULES=0,2 to time fewer rules, TMAS=0 or 1 for one key loop,
PERSIST=0,1,2 for the grids (programs per SM; 0: one per tile). (Commit 8cabe67 also timed the
backward kernels through tensor descriptors: benchmarks/results/tune-bwd-tma-H200-2026-11-22.txt;
removed, no end-to-end gain. The one-kernel backward with dQ by atomic adds that commit 58928ed
timed here was slower and was removed: docs/kernels.md, optimisation log.) Medians of do_bench; the
best of each is printed last. JSON under $OUT."""
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
FWD = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)]
DKDV = [(32, 64, 4, 3), (64, 128, 8, 3), (32, 128, 4, 3)]
DQ = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 8, 3)]
LOG2E = 1 / math.log(2)
RULE_NAMES = ("standard", "paper", "tie-shift", "all-shift")   # RULES: their RuleKind values
RULES = tuple(int(r) for r in os.environ.get("RULES", "0,1,2,3").split(","))
TMAS = tuple(bool(int(t)) for t in os.environ.get("TMAS", "0,1").split(","))
PERSIST = tuple(int(p) for p in os.environ.get("PERSIST", "0").split(","))
dev = "cuda"
rows = []
op._ensure_allocator()        # the TMA variants need Triton's scratch allocator


def fa2_config(stab: int):
    """The "fa2" bf16 forward under rule ``stab`` as a KernelConfig, or None in a tree from before
    the typed configuration (ab_kernels.sh runs this file against earlier trees too)."""
    try:
        from stableflash.attention.triton.config import Format, KernelConfig, RuleKind
    except ImportError:
        return None
    return KernelConfig(rule=RuleKind(stab), narrow=Format.BF16, narrow_out=True)


def fwd_switches(stab: int) -> dict:
    """The forward kernel's switches for the "fa2" bf16 forward under rule ``stab``: the launcher's
    ``op.forward_switches``, or an earlier tree's integer switches."""
    config = fa2_config(stab)
    if config is not None:
        return op.forward_switches(config)
    return dict(STAB=stab, EMU=False, MBITS=0, SR=False, ACC_NARROW=False, ROW_NARROW=False, O_NARROW=True,
                PBAR32=False, HP=False, PFMT=-1, SOFTCAP=False, KEEP_O32=False)


def fwd_lse(q, k, v, scale):
    """(O, LSE) of the standard "fa2" forward, for the backward's inputs."""
    config = fa2_config(0)
    o, lse, *_ = (op._forward(q, k, v, True, scale, config) if config is not None else
                 op._forward(q, k, v, True, scale, 0, 2.0, 1e-3, 0.13, 8.4, False, 0))
    return o, lse


def bench(fn):
    try:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    except Exception as exc:  # out of resources, a variant this Triton cannot compile, ...
        print("  failed:", type(exc).__name__, str(exc)[:200])
        return float("nan")


for shape in SHAPES:
    B, H, N, D = shape
    q, k, v, do = (torch.randn(*shape, device=dev, dtype=torch.bfloat16) for _ in range(4))
    o = torch.empty_like(q)
    lse = torch.empty(B, H, N, device=dev, dtype=torch.float32)
    st = lambda t: (t.stride(0), t.stride(1), t.stride(2))  # noqa: E731
    scale = D ** -0.5
    o32 = torch.empty(0, device=dev, dtype=torch.float32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bm, bn, w, s in ([] if os.environ.get("BWD_ONLY") == "1" else FWD):
        for stab in RULES:
            for tma in TMAS:
                for per in PERSIST:
                    grid = (min(triton.cdiv(N, bm) * B * H, per * sms),) if per else (triton.cdiv(N, bm), B * H)

                    def fwd():
                        attn_fwd_kernel[grid](
                            q, k, v, v, o, lse, o32, *st(q), *st(k), *st(v), *st(o), n_heads=H, group=1, n_q=N, n_k=N,
                            n_bh=B * H, scale=scale * LOG2E, beta=2.0, eps=1e-3 * LOG2E, lo=0.13 * LOG2E,
                            hi=8.4 * LOG2E, period=1.0, seed=0, hp_mask=0, cap_in=0.0, cap_out=0.0, HEAD_DIM=D,
                            BLOCK_M=bm, BLOCK_N=bn, CAUSAL=True, **fwd_switches(stab), PERSISTENT=per > 0, TMA=tma,
                            INTERP=False, num_warps=w, num_stages=s)
                    kernel = ("fwd-tma" if tma else "fwd") + (f"-persistent{per}" if per else "")
                    rows.append(dict(shape=shape, kernel=kernel, cfg=(bm, bn, w, s), stab=stab, ms=bench(fwd)))
    if os.environ.get("FWD_ONLY") == "1":
        continue
    # the backward needs a real lse and delta
    o, lse = fwd_lse(q, k, v, scale)
    delta = (o.float() * do.float()).sum(-1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = (*st(q), *st(k), *st(v), *st(do))
    for bm, bn, w, s in DKDV:
        def dkdv():
            bw.attn_bwd_dkdv_kernel[(triton.cdiv(N, bn), B * H)](
                q, k, v, do, lse, delta, dk, dv, *common, *st(dk), H, 1, N, N, scale, 0.0, HEAD_DIM=D, BLOCK_M=bm,
                BLOCK_N=bn, CAUSAL=True, EMU=False, SOFTCAP=False, INTERP=False, num_warps=w, num_stages=s)
        rows.append(dict(shape=shape, kernel="dkdv", cfg=(bm, bn, w, s), ms=bench(dkdv)))
    for bm, bn, w, s in DQ:
        def dq_():
            bw.attn_bwd_dq_kernel[(triton.cdiv(N, bm), B * H)](
                q, k, v, do, lse, delta, dq, *common, *st(dq), H, 1, N, N, scale, 0.0, HEAD_DIM=D, BLOCK_M=bm,
                BLOCK_N=bn, CAUSAL=True, EMU=False, SOFTCAP=False, INTERP=False, num_warps=w, num_stages=s)
        rows.append(dict(shape=shape, kernel="dq", cfg=(bm, bn, w, s), ms=bench(dq_)))
    torch.cuda.empty_cache()

json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "tune.json"), "w"), indent=1)
print(f"\n{'shape':>20} {'variant':28} {'best ms':>8} {'config':>18}")
for shape in SHAPES:
    best = {}
    for r in rows:
        if r["shape"] != shape or math.isnan(r["ms"]):
            continue
        label = r["kernel"] + (f" {RULE_NAMES[r['stab']]}" if "stab" in r else "")
        if label not in best or r["ms"] < best[label]["ms"]:
            best[label] = r
    for label, r in best.items():
        print(f"{str(shape):>20} {label:28} {r['ms']:8.3f} {str(r['cfg']):>18}")
    if "dkdv" in best and "dq" in best:
        print(f"{str(shape):>20} {'bwd (dkdv + dq)':28} {best['dkdv']['ms'] + best['dq']['ms']:8.3f}")
