"""Per-kernel GPU time of one attention call, ours against a peer, read by torch's profiler.

    python benchmarks/tools/kernel_breakdown.py [--shape 8,16,2048,128 ...] [--providers stableflash sdpa-default]
        [--no-causal] [--forward-only] [--layout bhnd|bnhd] [--calls 20] [--json OUT.json]

For each shape and provider (``stableflash bench attention``'s provider names and random inputs, laid
out as ``--layout`` says: (B, H, N, d) contiguous, or the packed (B, N, 3, H, d) buffer a model passes,
which ``interleaved_bench.py`` times): five warm-up calls of forward + backward (``torch.autograd.grad``
of the output with a fixed dO; with ``--forward-only`` the forward under ``no_grad``), then ``--calls``
calls under ``torch.profiler``; prints, per provider, each GPU kernel's time per call (µs, largest
first) and the total. Both causal switches unless one is named. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

from stableflash.bench.attention import LAYOUTS, ROUTE_SHAPES
from stableflash.cli import _provider, _shape   # `stableflash bench attention`'s --shape and --providers


def kernel_times(shape, provider: str, causal: bool, forward_only: bool, calls: int,
                 layout: str = "bhnd") -> dict[str, float]:
    """kernel name → µs per call of ``provider`` at ``shape``, inputs laid out as ``layout``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from stableflash.bench.attention import _inputs, provider_context, provider_fn
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = _inputs(shape, torch.bfloat16, "cuda", gen, layout)
    fn = provider_fn(provider, shape, causal, "cuda")
    leaves = [t.detach().requires_grad_(not forward_only) for t in (q, k, v)]

    def call():
        with provider_context(provider):
            if forward_only:
                with torch.no_grad():
                    fn(*leaves, causal)
            else:
                torch.autograd.grad(fn(*leaves, causal), leaves, do)
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] += e.device_time / calls
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs="+", type=_shape, default=list(ROUTE_SHAPES),
                    help="B,H,N,d shapes (default: the Hopper route's five, bench.attention.ROUTE_SHAPES)")
    ap.add_argument("--providers", nargs="+", type=_provider, default=["stableflash", "sdpa-default"])
    ap.add_argument("--no-causal", action="store_true", help="non-causal only (default: causal, then non-causal)")
    ap.add_argument("--causal", action="store_true", help="causal only")
    ap.add_argument("--forward-only", action="store_true", help="the forward alone")
    ap.add_argument("--layout", choices=LAYOUTS, default="bhnd",
                    help="the inputs' memory: bhnd (B, H, N, d) contiguous (default), or bnhd, q, k, v views of "
                         "one packed (B, N, 3, H, d) buffer and dO (B, N, H, d), as a model passes them")
    ap.add_argument("--calls", type=int, default=20, help="profiled calls per provider (default 20)")
    ap.add_argument("--json", type=Path, help="also write the times here")
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error(f"--calls {args.calls} is invalid; accepted: a positive integer")
    if args.causal and args.no_causal:
        ap.error("--causal and --no-causal together are invalid; accepted: one of them, or neither (both switches)")
    import torch
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (it profiles the kernels there); none is visible")
    switches = [False] if args.no_causal else [True] if args.causal else [True, False]
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": args.calls,
           "mode": "fwd" if args.forward_only else "fwd+bwd", "layout": args.layout, "us_per_call": {}}
    for causal in switches:
        for shape in args.shape:
            for provider in args.providers:
                times = kernel_times(shape, provider, causal, args.forward_only, args.calls, args.layout)
                key = f"{'causal' if causal else 'non-causal'} {'x'.join(map(str, shape))} {provider}"
                out["us_per_call"][key] = {k: round(v, 2) for k, v in times.items()}
                print(f"{key}: {sum(times.values()):.1f} µs")
                for name, us in times.items():
                    print(f"   {us:9.1f}  {name[:120]}")
                sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
