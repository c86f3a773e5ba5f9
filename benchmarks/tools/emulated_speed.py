"""Speed of the emulated backend, forward and backward, on one causal bf16 attention layer: each
policy against float64, and the time per call. Runs on CPU or GPU (whichever torch sees).
Usage: python3 benchmarks/tools/emulated_speed.py [B H N d]"""
import sys
import time

import torch

from stableflash.attention import reference
from stableflash.attention.emulated import emulated_backward, emulated_forward
from stableflash.attention.policy import PrecisionPolicy
from stableflash.attention.shift import ShiftRule

dev = "cuda" if torch.cuda.is_available() else "cpu"
B, H, N, D = (int(a) for a in sys.argv[1:5]) if len(sys.argv) == 5 else (2, 12, 1024, 64)
g = torch.Generator().manual_seed(0)
q, k, v, do = (torch.randn(B, H, N, D, generator=g).bfloat16().to(dev) for _ in range(4))
ref = reference.attention(q.double(), k.double(), v.double(), causal=True)


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


print(f"emulated backend, causal bf16 {B}x{H}x{N}x{D} on {dev} (torch {torch.__version__})")
for name in ("fa2", "paper"):
    pol = PrecisionPolicy.preset(name)
    times = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        res = emulated_forward(q, k, v, causal=True, scale=D ** -0.5, policy=pol, rule=ShiftRule("tie-shift"))
        sync()
        t1 = time.perf_counter()
        emulated_backward(q, k, v, res.out, res.lse, do, causal=True, scale=D ** -0.5, policy=pol)
        sync()
        times.append((t1 - t0, time.perf_counter() - t1))
    fwd, bwd = sorted(times)[1]
    err = ((res.out.double() - ref).norm() / ref.norm()).item()
    print(f"  {name:6s} forward {fwd * 1e3:8.1f} ms  backward {bwd * 1e3:8.1f} ms  O error vs float64 {err:.3e}")
