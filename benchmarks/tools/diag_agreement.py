"""How closely the Triton kernel follows the emulated backend on this machine, per policy.

For each case: fraction of elements that differ, the largest difference in bf16 ulps of the
tensor's largest value, and both backends' error against float64 (‖err‖/‖ref‖)."""
import json
import os

import torch

import stableflash as sf
from stableflash.attention import reference
from stableflash.attention.triton import op
from stableflash.numerics import ulp

op.AUTOTUNE = False
dev = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator(device=dev).manual_seed(0)
rows = []
for shape in ((2, 2, 70, 32), (2, 4, 512, 64)):
    q, k, v, do = (torch.randn(*shape, generator=g, device=dev).bfloat16() for _ in range(4))
    want = reference.forward_backward(q, k, v, do, causal=True)
    for policy in ("fa2", "paper"):
        for stab in (False, True):
            res = {}
            for be in ("triton", "emulated"):
                leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
                kw = dict(block_q=64, block_k=64) if be == "emulated" else {}
                o = sf.flash_attention(*leaves, causal=True, backend=be, policy=policy, stabilize=stab, **kw)
                res[be] = (o, *torch.autograd.grad(o, leaves, do))
            for i, name in enumerate(("O", "dQ", "dK", "dV")):
                a, b, w = res["triton"][i].double(), res["emulated"][i].double(), want[i]
                top = ulp(b.abs().max().reshape(1), "bf16").item()
                rows.append(dict(shape=shape, policy=policy, stab=stab, t=name,
                                 differ=(a != b).double().mean().item(), max_ulp=((a - b).abs().max() / top).item(),
                                 mean_ulp=((a - b).abs().mean() / top).item(),
                                 err_triton=((a - w).norm() / w.norm()).item(),
                                 err_emulated=((b - w).norm() / w.norm()).item()))
out = os.environ.get("OUT", "/tmp")
json.dump(rows, open(f"{out}/diag_agreement.json", "w"), indent=1)
for r in rows:
    print(f"{str(r['shape']):16s} {r['policy']:5s} {str(r['stab']):5s} {r['t']:2s} differ {r['differ']:.4f} "
          f"max {r['max_ulp']:.2f} mean {r['mean_ulp']:.4f} ulp | err triton {r['err_triton']:.3e} "
          f"emulated {r['err_emulated']:.3e}")
