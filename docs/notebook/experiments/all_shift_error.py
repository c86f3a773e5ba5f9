"""How far is each stabilization's error against float64 from SDPA's and from the emulated
backend's (the same algorithm in PyTorch), at the full shapes of the kernels' GPU test, over three
input draws each? (GPU.) The draws are those ``tests/conftest.gen`` seeds from a test's name: the
test's parameter before and after the rules were renamed (bounded → all-shift), and one more.

    PYTHONPATH=src python3 docs/notebook/experiments/all_shift_error.py

Prints, per stabilization, shape and draw, err(triton)/err(emulated) and err(triton)/err(SDPA)
for O, dQ, dK and dV.
"""
import sys

import torch

sys.path.insert(0, ".")
from stableflash.attention import reference  # noqa: E402
from tests.attention.test_triton import make, run  # noqa: E402
from tests.conftest import rel_err  # noqa: E402

shapes = [(2, 12, 1024, 64), (1, 16, 4096, 64), (1, 8, 2048, 128), (2, 4, 1000, 256)]
for stab in ("all-shift", "all-shift+consistent-delta", "paper", True):
    for i, shape in enumerate(shapes):
        for tag in ("all-shift", "bounded", "x1"):
            seed = sum(map(ord, f"test_full_shapes_against_sdpa[{tag}-shape{i}]")) * 7919 % (2**31)
            q, k, v, do = make(torch.Generator().manual_seed(seed), *shape)
            want = reference.forward_backward(q, k, v, do, causal=True)
            tri = run(q, k, v, do, causal=True, stabilize=stab, backend="triton")
            emu = run(q, k, v, do, causal=True, stabilize=stab, backend="emulated")
            sd = run(q, k, v, do, causal=True, stabilize=False, backend="sdpa")
            print(f"{str(stab):26s} {str(shape):18s} {tag:9s} tri/emu "
                  + " ".join(f"{rel_err(a, w) / rel_err(e, w):.2f}" for a, e, w in zip(tri, emu, want))
                  + "  tri/sdpa " + " ".join(f"{rel_err(a, w) / rel_err(e, w):.2f}" for a, e, w in zip(tri, sd, want)),
                  flush=True)
            del want, tri, emu, sd
            torch.cuda.empty_cache()
