"""SHA-256 digests of the Triton kernels' O, dQ, dK and dV over a fixed list of configurations:
evidence that a change to the kernel layer left their arithmetic alone (equal digests before and
after, on the same device), where a tolerance would hide a changed branch.

    TRITON_INTERPRET=1 python benchmarks/tools/kernel_digest.py [--out FILE] [--only NAME ...]
    python benchmarks/tools/kernel_digest.py --out FILE          # on a GPU, without the interpreter
    python benchmarks/tools/kernel_digest.py --compare A.json B.json

Every rule kind, "fa2" and the "paper" emulation, narrowed points (bf16, e8mY, fp16, fp8, nearest-
even and stochastic), P̄ in fp32 and fp8 (with the fp8 P̄V product), fp32 heads, every δ source,
soft-capping, causal and not, a chosen key block, grouped-query heads and fp16 inputs. The kernels
are called through ``launch.triton_attention`` (rule, policy, softcap, block_k), whose signature
trees before and after the typed kernel configuration share, so that digests of two source trees
(``PYTHONPATH=<tree>/src``) compare. Inputs come from fixed seeds, with a few keys repeated so that
rows hold tied maxima; stochastic rounding draws its seed after ``torch.manual_seed(0)``. Autotuning
is off (fixed tiles). Digests compare only within one device kind: the interpreter's arithmetic is
not the GPU's.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import sys
import warnings
from pathlib import Path

import torch

from stableflash.attention import PrecisionPolicy, ShiftRule

SHAPE = (1, 2, 2, 40, 70, 16)       # B, H, H_kv, n_q, n_k, d


def _configs() -> dict[str, dict]:
    """name → keyword arguments of ``_run`` (rule kind, policy, ...)."""
    fa2, paper = PrecisionPolicy.preset("fa2"), PrecisionPolicy.preset("paper")
    fa2_16 = PrecisionPolicy.preset("fa2", "fp16")
    e8m5 = paper.replace(acc="e8m5", row_sum="e8m5", out="e8m5")
    fp8 = fa2.replace(p_bar="fp8_e4m3", out="fp8_e4m3")
    out = {}
    for kind in ("standard", "paper", "tie-shift", "all-shift"):
        out[f"fa2 {kind}"] = dict(kind=kind, policy=fa2)
        out[f"paper {kind}"] = dict(kind=kind, policy=paper)
        out[f"fa2 {kind} not causal"] = dict(kind=kind, policy=fa2, causal=False)
        out[f"fa2 {kind} large logits"] = dict(kind=kind, policy=fa2, q_scale=8.0)   # shifts beyond max_shift
    out.update({
        "paper tie-shift not causal": dict(kind="tie-shift", policy=paper, causal=False),
        "paper tie-shift large logits": dict(kind="tie-shift", policy=paper, q_scale=8.0),
        "paper all-shift large logits": dict(kind="all-shift", policy=paper, q_scale=8.0),
        # narrowed points, nearest-even and stochastic
        "fa2 out e8m4": dict(policy=fa2.replace(out="e8m4")),
        "fa2 out fp16": dict(policy=fa2.replace(out="fp16")),
        "fa2 out bf16 stochastic": dict(policy=fa2.replace(out="bf16:stochastic")),
        "fa2 out e8m3 stochastic": dict(policy=fa2.replace(out="e8m3:stochastic")),
        "fa2 out fp16 stochastic": dict(policy=fa2.replace(out="fp16:stochastic")),
        "paper e8m5": dict(policy=e8m5),
        "paper e8m5 tie-shift": dict(kind="tie-shift", policy=e8m5),
        "paper e8m5 stochastic": dict(policy=paper.replace(acc="e8m5:stochastic", row_sum="e8m5:stochastic",
                                                           out="e8m5:stochastic")),
        "paper acc fp16 row_sum fp16 out fp16": dict(policy=paper.replace(acc="fp16", row_sum="fp16", out="fp16")),
        "paper acc e8m5 row_sum e8m5 out fp32": dict(policy=paper.replace(acc="e8m5", row_sum="e8m5", out="fp32")),
        "paper acc fp32 row_sum e8m5 out e8m5": dict(policy=paper.replace(acc="fp32", row_sum="e8m5", out="e8m5")),
        # P̄'s format, the fp8 product
        "fa2 p_bar fp32": dict(policy=fa2.replace(p_bar="fp32")),
        "paper p_bar fp32 acc fp32 row_sum e8m5 out e8m5": dict(
            policy=paper.replace(p_bar="fp32", acc="fp32", row_sum="e8m5", out="e8m5")),
        "fa2 p_bar e8m3": dict(policy=fa2.replace(p_bar="e8m3")),
        "fa2 p_bar fp16 out fp16": dict(policy=fa2.replace(p_bar="fp16", out="fp16")),
        "fa2 p_bar fp8_e4m3 out bf16": dict(policy=fa2.replace(p_bar="fp8_e4m3")),
        "fa2 p_bar fp8_e4m3 out fp8_e4m3": dict(kind="tie-shift", policy=fp8),
        "fa2 p_bar fp8_e5m2 out fp8_e5m2 stochastic": dict(policy=fa2.replace(p_bar="fp8_e5m2",
                                                                              out="fp8_e5m2:stochastic")),
        "fa2 fp8 product e4m3": dict(kind="tie-shift", policy=fa2.replace(p_bar="fp8_e4m3", v_bar="fp8_e4m3")),
        "fa2 fp8 product e5m2": dict(policy=fa2.replace(p_bar="fp8_e5m2", v_bar="fp8_e5m2")),
        "fa2 fp8 product e4m3 dO·(O16+R)": dict(policy=fa2.replace(p_bar="fp8_e4m3", v_bar="fp8_e4m3",
                                                                   delta="dO·(O16+R)")),
        "paper p_bar fp8_e4m3 acc fp8_e4m3": dict(policy=paper.replace(p_bar="fp8_e4m3", acc="fp8_e4m3",
                                                                       row_sum="fp8_e4m3", out="fp8_e4m3")),
        # fp32 heads
        "fa2 hp_heads 1": dict(policy=fa2.replace(hp_heads=(1,))),
        "fa2 p_bar fp16 hp_heads 1": dict(policy=fa2.replace(p_bar="fp16", hp_heads=(1,))),
        "fa2 fp8 hp_heads 0": dict(policy=fp8.replace(hp_heads=(0,))),
        "paper e8m5 hp_heads 1": dict(kind="tie-shift", policy=e8m5.replace(hp_heads=(1,))),
        "paper e8m5 hp_heads 0 dP·P": dict(policy=e8m5.replace(hp_heads=(0,), delta="dP·P")),
        # δ sources
        "fa2 out fp32 (O kept in fp32 for dO·O)": dict(policy=fa2.replace(out="fp32")),
        "fa2 dO·O32": dict(policy=fa2.replace(delta="dO·O32")),
        "fa2 out e8m4 dO·O32": dict(policy=fa2.replace(out="e8m4", delta="dO·O32")),
        "fa2 dO·(O+R)": dict(kind="tie-shift", policy=fa2.replace(delta="dO·(O+R)")),
        "fa2 out e8m4 dO·(O+R)": dict(policy=fa2.replace(out="e8m4", delta="dO·(O+R)")),
        "fa2 fp8 dO·O16": dict(policy=fp8.replace(delta="dO·O16")),
        "fa2 fp8 dO·(O16+R)": dict(policy=fp8.replace(delta="dO·(O16+R)")),
        "fa2 dO·O16": dict(policy=fa2.replace(delta="dO·O16")),
        "fa2 dP·P": dict(policy=fa2.replace(delta="dP·P")),
        "fa2 recompute_fp32": dict(kind="tie-shift", policy=fa2.replace(delta="recompute_fp32")),
        "fa2 consistent": dict(policy=fa2.replace(delta="consistent")),
        "paper dP·P": dict(policy=paper.replace(delta="dP·P")),
        "paper recompute_fp32": dict(policy=paper.replace(delta="recompute_fp32")),
        "paper e8m5 dO·O32": dict(policy=e8m5.replace(delta="dO·O32")),
        "paper e8m5 dO·(O+R)": dict(policy=e8m5.replace(delta="dO·(O+R)")),
        # soft-capping, key blocks, grouped-query heads, head_dim 32, fp16 inputs
        "fa2 softcap 5": dict(kind="tie-shift", policy=fa2, softcap=5.0),
        "fa2 softcap 5 not causal dP·P": dict(policy=fa2.replace(delta="dP·P"), softcap=5.0, causal=False),
        "paper softcap 5": dict(kind="tie-shift", policy=paper, softcap=5.0),
        "paper e8m5 key block 32": dict(policy=e8m5, block_k=32),
        "paper key block 64 all-shift": dict(kind="all-shift", policy=paper, block_k=64),
        "paper key block 128 not causal": dict(kind="tie-shift", policy=paper, block_k=128, causal=False),
        "fa2 grouped-query heads": dict(kind="tie-shift", policy=fa2, shape=(1, 4, 2, 40, 70, 16)),
        "paper grouped-query heads dP·P": dict(policy=paper.replace(delta="dP·P"), shape=(1, 4, 2, 40, 70, 16)),
        "fa2 fp8 product grouped-query heads": dict(policy=fa2.replace(p_bar="fp8_e4m3", v_bar="fp8_e4m3"),
                                                    shape=(1, 4, 2, 40, 70, 16)),
        "fa2 head_dim 32": dict(kind="tie-shift", policy=fa2, shape=(1, 2, 2, 40, 70, 32)),
        "paper e8m5 head_dim 32 not causal": dict(policy=e8m5, shape=(2, 2, 1, 33, 50, 32), causal=False),
        "fp16 fa2": dict(policy=fa2_16, dtype=torch.float16),
        "fp16 fa2 tie-shift dO·(O+R)": dict(kind="tie-shift", policy=fa2_16.replace(delta="dO·(O+R)"),
                                            dtype=torch.float16),
        "fp16 fa2 dP·P not causal": dict(policy=fa2_16.replace(delta="dP·P"), dtype=torch.float16, causal=False),
        "fp16 fa2 dO·O32 softcap 5": dict(policy=fa2_16.replace(delta="dO·O32"), dtype=torch.float16, softcap=5.0),
    })
    return out


def _inputs(shape, dtype, device, q_scale=1.5):
    """q, k, v, dO from a fixed seed, q times ``q_scale``; key 5, lengthened, repeated at keys 12,
    25, 33 and 55, and key 9 at 20, 38 and 64 (where there are): many rows hold exactly tied maxima,
    within and across key blocks, causal or not."""
    B, H, H_kv, n_q, n_k, d = shape
    g = torch.Generator().manual_seed(1234)
    q = torch.randn(B, H, n_q, d, generator=g) * q_scale
    k = torch.randn(B, H_kv, n_k, d, generator=g)
    v = torch.randn(B, H_kv, n_k, d, generator=g)
    do = torch.randn(B, H, n_q, d, generator=g)
    k[:, :, 5] *= 2.5
    for src, copies in ((5, (12, 25, 33, 55)), (9, (20, 38, 64))):
        for j in copies:
            if j < n_k:
                k[:, :, j] = k[:, :, src]
    return [t.to(dtype).to(device) for t in (q, k, v, do)]


def _run(device, kind="standard", policy=None, causal=True, softcap=None, block_k=None, shape=SHAPE,
         dtype=torch.bfloat16, q_scale=1.5) -> dict[str, str]:
    from stableflash.attention.triton.launch import triton_attention
    q, k, v, do = _inputs(shape, dtype, device, q_scale)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    torch.manual_seed(0)                              # the stochastic rounding's seed
    kw = dict(scale=shape[-1] ** -0.5, rule=ShiftRule(kind), policy=policy, softcap=softcap, block_k=block_k)
    if "masking" in inspect.signature(triton_attention).parameters:     # a tree with masks: (O, LSE)
        from stableflash.attention.masking import Masking
        o = triton_attention(q, k, v, masking=Masking(causal=causal), **kw)[0]
    else:
        o = triton_attention(q, k, v, causal=causal, **kw)
    grads = torch.autograd.grad(o, (q, k, v), do)
    return {name: hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, t in zip(("O", "dQ", "dK", "dV"), (o, *grads))}


def compare(a: Path, b: Path) -> int:
    """Print the configurations whose digests differ between two outputs; 0 if none does."""
    da, db = (json.loads(p.read_text())["digests"] for p in (a, b))
    differ = [n for n in sorted(set(da) | set(db)) if da.get(n) != db.get(n)]
    for n in differ:
        print(f"differs: {n}: {da.get(n)} vs {db.get(n)}")
    print(f"{len(set(da) & set(db)) - len([n for n in differ if n in da and n in db])} of "
          f"{len(set(da) | set(db))} configurations identical ({a} vs {b})")
    return 1 if differ else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the digests as JSON here")
    ap.add_argument("--only", nargs="*", help="configuration names to run (default: all)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two outputs and exit")
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    import triton

    from stableflash.attention.triton import op
    op.AUTOTUNE = False                               # fixed tiles: the same kernels on every run
    warnings.filterwarnings("ignore", category=RuntimeWarning)     # the interpreter's numpy: inf − inf
    interp = op.interpreting()
    if not interp and not torch.cuda.is_available():
        sys.exit("no GPU: run under the Triton interpreter, TRITON_INTERPRET=1")
    device = "cpu" if interp else "cuda"
    configs = _configs()
    names = args.only or list(configs)
    digests = {}
    for name in names:
        digests[name] = _run(device, **configs[name])
        print(f"{name:55s} " + " ".join(f"{k} {h[:12]}" for k, h in digests[name].items()), flush=True)
    if args.out:
        where = "interpreter" if interp else torch.cuda.get_device_name()
        args.out.write_text(dumps({"triton": triton.__version__, "torch": torch.__version__, "device": where},
                                  digests))


def dumps(meta: dict, digests: dict) -> str:
    """JSON of ``meta`` and the digests, one configuration a line."""
    rows = ",\n".join(f"  {json.dumps(n, ensure_ascii=False)}: {json.dumps(d)}" for n, d in digests.items())
    head = json.dumps(meta, ensure_ascii=False)[:-1]
    return f'{head}, "digests": {{\n{rows}\n}}}}\n'



if __name__ == "__main__":
    main()
