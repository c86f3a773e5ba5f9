"""Speed of packed (varlen) and sliding-window attention against torch's peers, in one run.

    python benchmarks/tools/masking_speed.py --out DIR [--quick]

Cases (bf16, causal, forward + backward):
  varlen: documents packed along one axis (cu_seqlens), lengths drawn once from a fixed seed;
    peers: FlashAttention-2's varlen kernel through SDPA on a jagged nested tensor
    (``sdpa_kernel(FLASH_ATTENTION)``), and FlexAttention with a document-causal block mask.
  window: causal with a window of W keys to the left (Mistral-style);
    peers: FlexAttention with a sliding-window block mask, SDPA's efficient and cuDNN backends
    with the window as an explicit boolean mask, and SDPA's FlashAttention-2 on full causal
    attention (no window: the same call doing more work, an upper bound on the window's worth).
Ours: ``stableflash.flash_attn_varlen_func`` / ``flash_attention(window=...)`` on the kernels
(backend="triton") with the default stabilization, and with stabilize="none" (the stabilization's
cost).

Correctness first: each provider is compared with float64 (every sequence's dense softmax under
``masking.visible``) on fresh random inputs at a reduced size of each case before anything is
timed. Times: medians of ``triton.testing.do_bench`` (events). TFLOP/s count only the visible
(query, key) pairs: 4·d FLOPs per pair forward, 3.5× that forward + backward. Ratios: the peer's
time over ours (> 1: ours is faster). Writes masking-speed.json and masking-speed.txt to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import torch

import stableflash
from stableflash.attention.masking import Alignment, Masking, Window, visible

DTYPE = torch.bfloat16


def doc_lengths(total: int, mean: int, cap: int, seed: int) -> list[int]:
    """Document lengths (exponential with this mean, 1..cap) filling ``total`` tokens exactly."""
    g = torch.Generator().manual_seed(seed)
    out, left = [], total
    while left > 0:
        n = int(min(cap, max(1, round(float(torch.empty(1).exponential_(1.0 / mean, generator=g))))))
        n = min(n, left)
        out.append(n)
        left -= n
    return out


def varlen_pairs(lengths) -> int:
    return sum(n * (n + 1) // 2 for n in lengths)


def window_pairs(b, h, n, w) -> int:
    return b * h * sum(min(i, w) + 1 for i in range(n))


def reference_varlen(q, k, v, do, lengths):
    """float64 O and gradients, each document causal on its own; q, k, v (total, H, d)."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in leaves)
        s = qs @ ks.transpose(-1, -2) * q.shape[-1] ** -0.5
        s = s.masked_fill(~visible(n, n, Masking(causal=True), q.device), -math.inf)
        outs.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
        start += n
    o = torch.cat(outs)
    return (o.detach(), *torch.autograd.grad(o, leaves, do.double()))


def reference_window(q, k, v, do, w):
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    n = q.shape[2]
    s = leaves[0] @ leaves[1].transpose(-1, -2) * q.shape[-1] ** -0.5
    s = s.masked_fill(~visible(n, n, Masking(True, Alignment.TOP_LEFT, Window(w, 0)), q.device), -math.inf)
    o = torch.softmax(s, -1) @ leaves[2]
    return (o.detach(), *torch.autograd.grad(o, leaves, do.double()))


def varlen_providers(lengths, h, d, device):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    total, longest = int(cu[-1]), max(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    mask = create_block_mask(lambda b, hh, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki), None, None, total, total,
                             device=device)
    flex = torch.compile(flex_attention)
    offsets = cu.to(torch.int64)

    def ours(stabilize):
        return lambda q, k, v: stableflash.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True,
                                                                  stabilize=stabilize, backend="triton")

    def sdpa_flash(q, k, v):
        nq, nk, nv = (torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(nq, nk, nv, is_causal=True)
        return o.transpose(1, 2).values()

    def flex_fn(q, k, v):
        o = flex(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), block_mask=mask)
        return o.squeeze(0).transpose(0, 1)

    return {"stableflash": ours(True), "stableflash-none": ours("none"), "sdpa-flash (varlen, nested)": sdpa_flash,
            "flex": flex_fn}


def window_providers(shape, w, device):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = shape[2]
    mask = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= w), None, None, n, n, device=device)
    flex = torch.compile(flex_attention)
    dense = visible(n, n, Masking(True, Alignment.TOP_LEFT, Window(w, 0)), device)

    def sdpa(backend, window=True):
        def fn(q, k, v):
            with sdpa_kernel(backend):
                if window:
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return fn

    return {"stableflash": lambda q, k, v: stableflash.flash_attention(q, k, v, causal=True, window=(w, 0),
                                                                       backend="triton"),
            "stableflash-none": lambda q, k, v: stableflash.flash_attention(q, k, v, causal=True, window=(w, 0),
                                                                            stabilize="none", backend="triton"),
            "flex": lambda q, k, v: flex(q, k, v, block_mask=mask),
            "sdpa-efficient (bool mask)": sdpa(SDPBackend.EFFICIENT_ATTENTION),
            "sdpa-cudnn (bool mask)": sdpa(SDPBackend.CUDNN_ATTENTION),
            "sdpa-flash (full causal, no window)": sdpa(SDPBackend.FLASH_ATTENTION, window=False)}


def rel(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def errors(fn, inputs, want) -> dict:
    q, k, v, do = inputs
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o = fn(*leaves)
    grads = torch.autograd.grad(o, leaves, do)
    return {key: rel(g, r) for key, g, r in zip(("O", "dQ", "dK", "dV"), (o, *grads), want)}


def time_fwd_bwd(fn, inputs) -> float:
    import triton.testing

    q, k, v, do = inputs
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]

    def call():
        o = fn(*leaves)
        torch.autograd.grad(o, leaves, do)
    return triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")


def randn(*shape, gen, device):
    return torch.randn(*shape, generator=gen, device=device).to(DTYPE)


def cases(quick: bool):
    """(kind, name, parameters, reduced parameters for the float64 check)."""
    if quick:
        return [("varlen", "varlen-small", dict(total=2048, mean=200, cap=512, h=4, d=64),
                 dict(total=512, mean=100, cap=256, h=2, d=64)),
                ("window", "window-small", dict(shape=(1, 4, 1024, 64), w=128), dict(shape=(1, 2, 512, 64), w=64))]
    return [("varlen", "varlen GPT-2 batch: 32K tokens, docs mean 384 (≤1024), H12 d64",
             dict(total=32768, mean=384, cap=1024, h=12, d=64), dict(total=2048, mean=384, cap=1024, h=2, d=64)),
            ("varlen", "varlen long: 64K tokens, docs mean 2048 (≤8192), H16 d128",
             dict(total=65536, mean=2048, cap=8192, h=16, d=128), dict(total=4096, mean=1024, cap=2048, h=2, d=128)),
            ("window", "window 512: (4,16,4096,64)", dict(shape=(4, 16, 4096, 64), w=512),
             dict(shape=(1, 2, 1024, 64), w=128)),
            ("window", "window 1024: (2,16,8192,128)", dict(shape=(2, 16, 8192, 128), w=1024),
             dict(shape=(1, 2, 1024, 128), w=256))]


def build(kind, p, device, gen):
    if kind == "varlen":
        lengths = doc_lengths(p["total"], p["mean"], p["cap"], seed=p["total"])
        inputs = tuple(randn(p["total"], p["h"], p["d"], gen=gen, device=device) for _ in range(4))
        return lengths, inputs, varlen_providers(lengths, p["h"], p["d"], device), 3.5 * 4 * p["d"] * p["h"] * \
            varlen_pairs(lengths)
    inputs = tuple(randn(*p["shape"], gen=gen, device=device) for _ in range(4))
    b, h, n, d = p["shape"]
    return None, inputs, window_providers(p["shape"], p["w"], device), 3.5 * 4 * d * window_pairs(b, h, n, p["w"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--quick", action="store_true", help="small cases (a smoke test)")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    import triton
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "command": "python benchmarks/tools/masking_speed.py " + " ".join(argv or sys.argv[1:]), "cases": []}
    for kind, name, params, small in cases(args.quick):
        lengths, inputs, providers, _ = build(kind, small, device, gen)
        want = (reference_varlen(*inputs, lengths) if kind == "varlen"
                else reference_window(*inputs, small["w"]))
        case = {"case": name, "kind": kind, "params": params, "check_params": small, "rows": []}
        checked = {}
        for pname, fn in providers.items():
            try:
                checked[pname] = errors(fn, inputs, want)
            except Exception as exc:           # a peer that cannot run this case: recorded, not timed
                checked[pname] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        lengths, inputs, providers, flop = build(kind, params, device, gen)
        if lengths is not None:
            case["documents"] = len(lengths)
        for pname, fn in providers.items():
            row = {"provider": pname, "errors_vs_fp64": checked[pname]}
            if "error" not in checked[pname]:
                try:
                    ms = time_fwd_bwd(fn, inputs)
                    row.update(ms=ms, tflops=flop / ms / 1e9)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            case["rows"].append(row)
            print(f"{name} | {pname}: {row.get('ms', row.get('error', checked[pname].get('error')))}", flush=True)
        ours = next(r for r in case["rows"] if r["provider"] == "stableflash")
        for r in case["rows"]:
            if "ms" in r and "ms" in ours:
                r["peer_time_over_ours"] = r["ms"] / ours["ms"]
        result["cases"].append(case)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "masking-speed.json").write_text(json.dumps(result, indent=1))
    lines = [f"# {result['command']}", f"# {result['gpu']}, torch {result['torch']}, triton {result['triton']}",
             "# bf16, causal, forward+backward; time over ours > 1: ours faster; errors vs float64 at the reduced size"]
    for case in result["cases"]:
        lines.append(f"\n## {case['case']}" + (f" ({case['documents']} documents)" if "documents" in case else ""))
        lines.append(f"{'provider':38} {'ms':>8} {'TFLOP/s':>8} {'t/ours':>7}  err O / dQ / dK / dV")
        for r in case["rows"]:
            e = r["errors_vs_fp64"]
            err = (" / ".join(f"{e[k]:.1e}" for k in ("O", "dQ", "dK", "dV")) if "O" in e else e.get("error", ""))
            if "ms" in r:
                lines.append(f"{r['provider']:38} {r['ms']:8.3f} {r['tflops']:8.1f} {r['peer_time_over_ours']:7.2f}  {err}")
            else:
                lines.append(f"{r['provider']:38} {'-':>8} {'-':>8} {'-':>7}  {r.get('error', err)}")
    text = "\n".join(lines)
    (args.out / "masking-speed.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
