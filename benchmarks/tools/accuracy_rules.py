"""Error against float64 of O, dQ, dK, dV (‖x − ref‖/‖ref‖) for each stabilization rule of the
Triton kernels, both backward paths (atomic dQ, deterministic), and torch SDPA's flash and cuDNN
backends, on fresh causal bf16 inputs. Prints a table; JSON to $OUT/accuracy.json."""
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import stableflash as sf
from stableflash.attention import reference

SHAPES = [(2, 12, 1024, 64), (1, 16, 4096, 64), (1, 8, 4096, 128)]
gen = torch.Generator().manual_seed(0)
rows = []


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def grads(fn, q, k, v, do):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = fn(q, k, v)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


for shape in SHAPES:
    q, k, v, do = (torch.randn(*shape, generator=gen).bfloat16().cuda() for _ in range(4))
    want = reference.forward_backward(q, k, v, do, causal=True)
    variants = {}
    for stab in ("none", "consistent-delta", "paper", "tie-shift", "all-shift"):
        variants[f"triton {stab}"] = lambda q, k, v, s=stab: sf.flash_attention(q, k, v, causal=True, stabilize=s,
                                                                               backend="triton")
    for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        def peer(q, k, v, b=backend):
            with sdpa_kernel(b):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        variants[name] = peer
    for name, fn in variants.items():
        got = grads(fn, q, k, v, do)
        rows.append(dict(shape=shape, variant=name, **{n: rel(g, w) for n, g, w in zip(("O", "dQ", "dK", "dV"), got, want)}))
    torch.use_deterministic_algorithms(True)
    got = grads(variants["triton consistent-delta"], q, k, v, do)
    torch.use_deterministic_algorithms(False)
    rows.append(dict(shape=shape, variant="triton consistent-delta, deterministic", **{n: rel(g, w) for n, g, w in
                                                                         zip(("O", "dQ", "dK", "dV"), got, want)}))

json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "accuracy.json"), "w"), indent=1)
print(f"{'shape':>20} {'variant':28} {'O':>9} {'dQ':>9} {'dK':>9} {'dV':>9}")
for r in rows:
    print(f"{str(tuple(r['shape'])):>20} {r['variant']:28} " + " ".join(f"{r[n]:9.3e}" for n in ("O", "dQ", "dK", "dV")))
