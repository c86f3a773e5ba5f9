"""Can a Triton flash-attention loop keep QKᵀ of the next key block in flight during this block's
softmax (FlashAttention-3's intra-warpgroup overlap) on Hopper? Compiled for sm_90 without a GPU.

    python benchmarks/tools/wgmma_overlap.py [--block-m 128] [--warps 8]

Two forms of the same minimal forward loop (standard row max, no masking): "plain" computes S = QKᵀ
and then its softmax in each iteration; "prefetch" issues the next block's S before this block's
softmax and carries it to the next iteration. For each, the asynchronous warpgroup products in the
key loop and the number of products each wait leaves in flight (``pendings``) are read off the
compiler's TTGIR: overlap needs a wait with pendings > 0 between the S product and the softmax.
The loop is compiled, never run (the prefetch form reads one key block past the end).
"""
from __future__ import annotations

import argparse
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _loop(Q, K, V, O, n_k, scale, PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims, keys = tl.arange(0, D), tl.arange(0, BLOCK_N)
    q = tl.load(Q + rows[:, None] * D + dims[None, :])
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    s = tl.dot(q, tl.load(K + keys[None, :] * D + dims[:, None])) if PREFETCH else acc
    for start in range(0, n_k, BLOCK_N):
        cols = start + keys
        v = tl.load(V + cols[:, None] * D + dims[None, :])
        if PREFETCH:       # the next block's S, issued before this block's softmax
            s_next = tl.dot(q, tl.load(K + (cols[None, :] + BLOCK_N) * D + dims[:, None]))
        else:
            s = tl.dot(q, tl.load(K + cols[None, :] * D + dims[:, None]))
        m_new = tl.maximum(m, tl.max(s, 1) * scale)
        p = tl.exp2(s * scale - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
        m = m_new
        if PREFETCH:
            s = s_next
    tl.store(O + rows[:, None] * D + dims[None, :], (acc / l[:, None]).to(tl.bfloat16))


def ttgir(prefetch: bool, block_m: int, warps: int) -> str:
    const = dict(PREFETCH=prefetch, BLOCK_M=block_m, BLOCK_N=64, D=64)
    names = _loop.arg_names
    sig = {n: "constexpr" if n in const else "*bf16" if n in "QKVO" else "fp32" if n == "scale" else "i32"
           for n in names}
    src = ASTSource(_loop, sig, constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=warps, num_stages=3)).asm["ttgir"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-m", type=int, default=128)
    p.add_argument("--warps", type=int, default=8)
    a = p.parse_args()
    print(f"triton {triton.__version__}, sm_90, BLOCK_M {a.block_m}, {a.warps} warps")
    for name, prefetch in (("plain", False), ("prefetch", True)):
        loop = ttgir(prefetch, a.block_m, a.warps).split("scf.for", 1)[1].split("scf.yield", 1)[0]
        dots = len(re.findall(r"ttng\.warp_group_dot\s", loop))
        waits = re.findall(r"warp_group_dot_wait.*?pendings = (\d+)", loop)
        print(f"{name:9s} key loop: {dots} async products, waits leaving {', '.join(waits) or 'none'} in flight")


if __name__ == "__main__":
    main()
