"""Error against float64 of the kernels' narrowing points rounded to nearest-even vs stochastically.

    python benchmarks/tools/sr_accuracy.py [--shape 1,2,96,32] [--inputs 4]

Without CUDA it runs the kernels in Triton's CPU interpreter (slow: keep the shape small). For
each policy pair it prints ‖err‖/‖ref‖ of O, dQ, dK, dV averaged over fresh random inputs, and the
ratio stochastic / nearest-even (a stochastic rounding has twice the variance: √2 expected).
"""
from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import stableflash as sf  # noqa: E402
from stableflash.attention import PrecisionPolicy, reference  # noqa: E402
from stableflash.attention.triton import op as triton_op  # noqa: E402

PAIRS = [("fa2, O in e8m3", PrecisionPolicy.preset("fa2").replace(out="e8m3")),
         ("paper, ℓ Ō O in e8m5", PrecisionPolicy.preset("paper").replace(acc="e8m5", row_sum="e8m5", out="e8m5")),
         ("fa2, O in bf16", PrecisionPolicy.preset("fa2"))]


def stochastic(policy: PrecisionPolicy) -> PrecisionPolicy:
    narrowed = ("out",) if policy.acc == "fp32" else ("acc", "row_sum", "out")
    return policy.replace(**{f: getattr(policy, f) + ":stochastic" for f in narrowed})


def errors(q, k, v, do, want, policy) -> list[float]:
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = sf.flash_attention(q, k, v, causal=True, backend="triton", policy=policy)
    got = (o, *torch.autograd.grad(o, (q, k, v), do))
    return [((g.double() - w).norm() / w.norm()).item() for g, w in zip(got, want)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,2,96,32")
    ap.add_argument("--inputs", type=int, default=4)
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    triton_op.AUTOTUNE = False
    torch.manual_seed(0)
    print(f"shape {shape}, {args.inputs} inputs, {device}{'' if device == 'cuda' else ' (Triton interpreter)'}")
    print(f"{'policy':24s} {'rounding':10s} {'O':>8} {'dQ':>8} {'dK':>8} {'dV':>8}")
    for label, rne in PAIRS:
        rows = {"nearest": [0.0] * 4, "stochastic": [0.0] * 4}
        for i in range(args.inputs):
            gen = torch.Generator().manual_seed(i)
            q, k, v, do = (torch.randn(*shape, generator=gen).bfloat16().to(device) for _ in range(4))
            want = reference.forward_backward(q, k, v, do, causal=True)
            for name, pol in (("nearest", rne), ("stochastic", stochastic(rne))):
                rows[name] = [a + b / args.inputs for a, b in zip(rows[name], errors(q, k, v, do, want, pol))]
        for name, vals in rows.items():
            print(f"{label:24s} {name:10s} " + " ".join(f"{x:8.4f}" for x in vals))
        print(f"{label:24s} {'ratio':10s} " + " ".join(f"{a / b:8.2f}" for a, b in
                                                       zip(rows["stochastic"], rows["nearest"])))


if __name__ == "__main__":
    main()
