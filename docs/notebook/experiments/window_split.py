"""Where the window-512 gap to FlexAttention sits: forward alone and forward + backward, ours
(the kernels, stabilized and not) against FlexAttention, at (4, 16, 4096, 64) causal with a
window of 512 keys, and ours at full causal for scale; the tiles the tuners chose.

    python docs/notebook/experiments/window_split.py
"""
import torch
import triton
import triton.testing
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import stableflash
from stableflash.attention.triton import op

B, H, N, D, W = 4, 16, 4096, 64, 512
dev = "cuda"
gen = torch.Generator(device=dev).manual_seed(0)
q, k, v, do = (torch.randn(B, H, N, D, generator=gen, device=dev).bfloat16() for _ in range(4))
mask = create_block_mask(lambda b, h, i, j: (i >= j) & (i - j <= W), None, None, N, N, device=dev)
flex = torch.compile(flex_attention)
fns = {
    "ours window": lambda a, b_, c: stableflash.flash_attention(a, b_, c, causal=True, window=(W, 0), backend="triton"),
    "ours-none window": lambda a, b_, c: stableflash.flash_attention(a, b_, c, causal=True, window=(W, 0),
                                                                     stabilize="none", backend="triton"),
    "flex window": lambda a, b_, c: flex(a, b_, c, block_mask=mask),
    "ours full causal": lambda a, b_, c: stableflash.flash_attention(a, b_, c, causal=True, backend="triton"),
}
rows = []
for name, fn in fns.items():
    with torch.no_grad():
        fwd = triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=200, return_mode="median")
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]

    def step():
        o = fn(*leaves)
        torch.autograd.grad(o, leaves, do)
    both = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
    rows.append((name, fwd, both, both - fwd))
print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}")
print(f"# ({B},{H},{N},{D}) causal, window {W}; ms, medians of triton.testing.do_bench")
print(f"{'':20} {'fwd':>8} {'fwd+bwd':>8} {'bwd (diff)':>10}")
for name, f, b, d in rows:
    print(f"{name:20} {f:8.3f} {b:8.3f} {d:10.3f}")
for kernel, choices in op.tuned_choices().items():
    for key, cfg in choices.items():
        print(f"tuned {kernel}: {key[:90]} -> {cfg}")
