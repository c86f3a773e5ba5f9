"""How far δ from O plus its bf16 rounding residual (`delta="dO·(O+R)"`) is from δ from O as computed
(`dO·O32`), against δ from the stored O: the share of bf16 dQ, dK entries that differ from dO·O32's,
per backend and O format (CPU: the Triton kernels run in the interpreter; small shape).

    TRITON_INTERPRET=1 python docs/notebook/experiments/residual_delta.py [--seed 0] [--shape 1,2,50,32]
"""
import argparse

import torch

import stableflash as sf
from stableflash.attention import PrecisionPolicy


def grads(q, k, v, do, **kw):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = sf.flash_attention(q, k, v, causal=True, stabilize="ours", **kw)
    return torch.autograd.grad(o, (q, k, v), do)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", default="1,2,50,32", help="B,H,N,d")
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    if len(shape) != 4 or min(shape) < 1:
        raise SystemExit(f"--shape {args.shape!r} is invalid; accepted: four positive ints B,H,N,d")
    from stableflash.attention.triton import op
    op.AUTOTUNE = False                                   # one fixed tile, as the tests use
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v, do = (torch.randn(*shape, generator=gen).to(dev, torch.bfloat16) for _ in range(4))
    print(f"shape {shape}, seed {args.seed}, {dev}: share of bf16 gradient entries differing from dO·O32's")
    print(f"{'O format':9s} {'backend':9s} {'grad':5s} {'dO·(O+R)':>9s} {'dO·O (stored)':>14s}")
    for out in ("bf16", "e8m4"):
        policy = PrecisionPolicy.preset("fa2").replace(out=out)
        for backend in ("emulated", "triton"):
            kw = dict(backend=backend)
            if backend == "emulated":
                kw.update(block_q=32, block_k=op.key_block(32))
            exact = grads(q, k, v, do, policy=policy.replace(delta="dO·O32"), **kw)
            pair = grads(q, k, v, do, policy=policy.replace(delta="dO·(O+R)"), **kw)
            stored = grads(q, k, v, do, policy=policy, **kw)
            for name, e, p, s in zip(("dQ", "dK"), exact, pair, stored):
                print(f"{out:9s} {backend:9s} {name:5s} {(p != e).float().mean().item():9.4f} "
                      f"{(s != e).float().mean().item():14.4f}")


if __name__ == "__main__":
    main()
