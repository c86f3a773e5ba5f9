"""Where the paper's rule (Algorithm 3, shift β·max on rows with tied maxima) stops being finite.

    python docs/notebook/experiments/paper_rule_underflow.py

Rows whose maximum is tied (two equal keys) at a growing value, ℓ, Ō and O in e8m5 under the
authors' emulation (the failing reproduction's arithmetic), on the emulated backend (CPU): for each
β, whether O and the gradients are finite. P̄ of the row maximum is e^−(β−1)·max, so ℓ leaves
fp32's normal range once (β − 1)·max passes about 87 (the CPU keeps subnormals a little further;
a GPU flushes them to zero).

A second table does the same with P̄ and O in fp8 e4m3 under real FA2 arithmetic (β = 2): there the
row maximum's P̄ = e^−max rounds to 0 once it falls below half of e4m3's smallest number 2⁻⁹, at
max > ln 2¹⁰ ≈ 6.9, and the tied rows' O is 0 while the exact attention's is not. It prints the
largest |O| of those rows per backend: "emulated", and "triton" where the kernels run (CUDA, or
TRITON_INTERPRET=1 on the CPU), with our rule beside it.
"""
import os

import torch

import stableflash as sf
from stableflash.attention import PrecisionPolicy, reference


def main() -> None:
    policy = PrecisionPolicy.preset("paper").replace(acc="e8m5", row_sum="e8m5", out="e8m5")
    gen = torch.Generator().manual_seed(0)
    n, d = 64, 32
    u = torch.randn(d, generator=gen)
    u = u / u.norm()
    v, do = (torch.randn(1, 2, n, d, generator=gen) for _ in range(2))
    print("row max    " + "  ".join(f"beta={b:g}".ljust(22) for b in BETAS))
    for top in (5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0):
        # every query is u; keys 0 and 1 are both u·top·√d (score = top, tied), the others small
        q = u.expand(1, 2, n, d).clone()
        k = 0.1 * torch.randn(1, 2, n, d, generator=gen)
        k[:, :, :2] = u * top * d ** 0.5
        cells = []
        for beta in BETAS:
            qq, kk, vv = (t.bfloat16().requires_grad_() for t in (q, k, v))
            o = sf.flash_attention(qq, kk, vv, causal=False, stabilize="paper", beta=beta, policy=policy,
                                   backend="emulated")
            o.backward(do.bfloat16())
            bad = [n for n, t in (("O", o), ("dQ", qq.grad), ("dK", kk.grad), ("dV", vv.grad))
                   if not torch.isfinite(t).all()]
            cells.append(("non-finite " + ",".join(bad)) if bad else "finite")
        print(f"{top:9.0f}  " + "  ".join(c.ljust(22) for c in cells))

    fp8_rows(gen, u, v, n, d)


def fp8_rows(gen, u, v, n, d) -> None:
    policy = PrecisionPolicy.preset("fa2").replace(p_bar="fp8_e4m3", out="fp8_e4m3")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    backends = ["emulated"] + (["triton"] if dev == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else [])
    cols = [f"{b} {rule}" for b in backends for rule in ("paper", "ours")] + ["exact"]
    print("\nP̄ and O in fp8 e4m3 (fa2), beta=2: largest |O| of the rows with a tied maximum")
    print("row max    " + "  ".join(c.ljust(16) for c in cols))
    for top in (2.0, 6.0, 7.0, 10.0, 20.0, 40.0):
        q = u.expand(1, 2, n, d).clone()
        k = 0.1 * torch.randn(1, 2, n, d, generator=gen)
        k[:, :, :2] = u * top * d ** 0.5
        qq, kk, vv = (t.bfloat16().to(dev) for t in (q, k, v))
        cells = []
        for backend in backends:
            for rule in ("paper", "ours"):
                o = sf.flash_attention(qq, kk, vv, causal=False, stabilize=rule, policy=policy, backend=backend)
                cells.append(f"{o.float().abs().max().item():.3g}")
        exact = reference.attention(qq.double(), kk.double(), vv.double(), causal=False)
        cells.append(f"{exact.abs().max().item():.3g}")
        print(f"{top:9.0f}  " + "  ".join(c.ljust(16) for c in cells))


BETAS = (2.0, 4.0, 8.0)

if __name__ == "__main__":
    main()
