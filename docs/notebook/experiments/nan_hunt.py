"""Search random attention inputs for non-finite outputs or gradients of the fused kernels.

    python3 docs/notebook/experiments/nan_hunt.py [TRIALS] [SPEC ...]

Each trial draws q, k, v, dO at one of several score magnitudes, with some keys duplicated (rows
with several equal maxima, the paper's case) and, in bf16 at large magnitude, many near-equal
scores that round to the same value. For each attention spec (``policy=...`` fields and ``rule``,
as in the model's attention spec, backend triton) it checks O, dQ, dK and dV for finiteness; the
first failing slice of each spec is saved to $OUT/nan-<n>.pt with its row statistics, and the
emulated backend is run on the same slice to tell the kernel's arithmetic from the rule's.
"""
import json
import os
import sys

import torch

import stableflash as sf
from stableflash.model.spec import parse_attention_spec

trials = int(sys.argv[1]) if len(sys.argv) > 1 else 100
specs = sys.argv[2:] or ["triton policy=paper acc=e8m5 row_sum=e8m5 out=e8m5 rule=ours",
                         "triton policy=paper acc=e8m5 row_sum=e8m5 out=e8m5",
                         "triton policy=paper rule=ours", "triton rule=ours"]
out = os.environ.get("OUT", "/tmp")
dev = "cuda"
B, H, N, D = 8, 6, 512, 64
mags = [1.0, 2.0, 4.0, 8.0, 16.0]


def draw(gen, mag):
    q, k, v, do = (torch.randn(B, H, N, D, generator=gen, device=dev) for _ in range(4))
    q, k = q * mag ** 0.5, k * mag ** 0.5
    dup = torch.randint(0, N, (N // 8,), generator=gen, device=dev)
    src = torch.randint(0, N, (N // 8,), generator=gen, device=dev)
    k[:, :, dup] = k[:, :, src]                           # equal keys: equal scores in every row
    return [t.to(torch.bfloat16) for t in (q, k, v, do)]


def attend(choice, q, k, v, do, backend):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = sf.flash_attention(q, k, v, causal=True, stabilize=choice.rule, beta=choice.beta, eps=choice.eps,
                           backend=backend, policy=choice.policy)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


found = {}
counts = {s: 0 for s in specs}
gen = torch.Generator(device=dev).manual_seed(0)
for t in range(trials):
    mag = mags[t % len(mags)]
    q, k, v, do = draw(gen, mag)
    for i, spec in enumerate(specs):
        choice = parse_attention_spec(spec).default
        res = attend(choice, q, k, v, do, "triton")
        bad = [name for name, x in zip(("O", "dQ", "dK", "dV"), res) if not torch.isfinite(x).all()]
        if not bad:
            continue
        counts[spec] += 1
        if spec in found:
            continue
        x = res[0] if "O" in bad else res[("O", "dQ", "dK", "dV").index(bad[0])]
        b, h = [int(j) for j in (~torch.isfinite(x)).nonzero()[0][:2]]
        rows = (~torch.isfinite(x[b, h])).any(-1).nonzero().flatten().tolist()
        sl = [t_[b:b + 1, h:h + 1] for t_ in (q, k, v, do)]
        emu = attend(choice, *sl, "emulated")
        kern = attend(choice, *sl, "triton")
        s = (sl[0].float() @ sl[1].float().transpose(-1, -2))[0, 0] * D ** -0.5
        row = rows[0]
        srow = s[row, :row + 1]
        info = {"spec": spec, "trial": t, "magnitude": mag, "bad": bad, "b": b, "h": h, "rows": rows[:20],
                "n_rows": len(rows),
                "slice_kernel_finite": [bool(torch.isfinite(z).all()) for z in kern],
                "slice_emulated_finite": [bool(torch.isfinite(z).all()) for z in emu],
                "row": row, "row_max": srow.max().item(),
                "row_ties_bf16": int((srow.bfloat16() == srow.bfloat16().max()).sum())}
        found[spec] = info
        torch.save({"q": sl[0], "k": sl[1], "v": sl[2], "do": sl[3], "info": info},
                   os.path.join(out, f"nan-{i}.pt"))
        print(json.dumps(info), flush=True)

print(f"\n{trials} trials of {B}x{H}x{N}x{D}, magnitudes {mags}")
for spec in specs:
    print(f"{counts[spec]:5d} non-finite  {spec}")
json.dump({"trials": trials, "counts": counts, "found": found}, open(os.path.join(out, "nan_hunt.json"), "w"),
          indent=1)
