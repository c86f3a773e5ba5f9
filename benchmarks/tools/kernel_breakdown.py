"""Per-kernel GPU time of one attention call, ours against a peer, read by torch's profiler.

    python benchmarks/tools/kernel_breakdown.py [--shape 8,16,2048,128 ...] [--providers stableflash sdpa-default]
        [--no-causal] [--forward-only] [--layout bhnd|bnhd] [--calls 20] [--graph] [--json OUT.json]

For each shape and provider (``stableflash bench attention``'s provider names and random inputs, laid
out as ``--layout`` says: (B, H, N, d) contiguous, or the packed (B, N, 3, H, d) buffer a model passes,
which ``interleaved_bench.py`` times): five warm-up calls of forward + backward (``torch.autograd.grad``
of the output with a fixed dO; with ``--forward-only`` the forward under ``no_grad``), then ``--calls``
calls under ``torch.profiler``; prints the GPU, torch and triton (the release and where it was imported
from), then per provider each GPU kernel's time per call (µs, largest first) and the total; ``--json``
writes the same with the versions. Both causal switches unless one is named. Needs a CUDA GPU.

``--graph``: the call captured once in a CUDA graph (as ``interleaved_bench.py``'s timing replays it)
and the graph replayed ``--calls`` times under the profiler: each kernel of one replay in the order it
ran, its time and the gap before it (averaged over the replays), the kernels' sum, the span from the
first kernel's start to the last one's end, and the replay's wall time by CUDA events (200 replays).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

from stableflash.bench.attention import LAYOUTS, ROUTE_SHAPES
from stableflash.cli import _provider, _shape   # `stableflash bench attention`'s --shape and --providers


def attention_call(shape, provider: str, causal: bool, forward_only: bool, layout: str):
    """One call of ``provider`` at ``shape`` on fixed random inputs laid out as ``layout``: forward and
    backward (``torch.autograd.grad`` of the output with a fixed dO), or the forward under ``no_grad``."""
    import torch

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
    return call


def kernel_times(shape, provider: str, causal: bool, forward_only: bool, calls: int,
                 layout: str = "bhnd") -> dict[str, float]:
    """kernel name → µs per call of ``provider`` at ``shape``, inputs laid out as ``layout``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call = attention_call(shape, provider, causal, forward_only, layout)
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


def graph_replay(shape, provider: str, causal: bool, forward_only: bool, calls: int, layout: str = "bhnd") -> dict:
    """One fwd+bwd call (or the forward) of ``provider`` captured in a CUDA graph: {"wall_us": a
    replay's time by CUDA events, "span_us", "kernel_sum_us", "kernels": [{"kernel", "us",
    "gap_before_us"}] in the order they ran}, the profiled figures averaged over ``calls`` replays."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call = attention_call(shape, provider, causal, forward_only, layout)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                           # warm-up off the capture's stream, as torch asks
        for _ in range(5):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / 200 * 1000
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    del graph
    return {"wall_us": wall, **per_replay([(e.name, e.time_range.start, e.time_range.end) for e in events], calls)}


def per_replay(events: list[tuple[str, float, float]], calls: int) -> dict:
    """{"span_us", "kernel_sum_us", "kernels"} of ``calls`` replays of one graph from the profiler's
    (kernel name, start µs, end µs) events: the kernels of a replay in the order they ran, each one's
    time and the gap between the previous one's end and its start (None for the first) averaged over
    the replays, and the span from a replay's first start to its last end, averaged. ValueError when
    the events are not the same kernels in every replay."""
    events = sorted(events, key=lambda e: e[1])
    if not events or len(events) % calls:
        raise ValueError(f"the profiler reported {len(events)} kernels for {calls} replays; expected a multiple")
    per = len(events) // calls
    replays = [events[j * per:(j + 1) * per] for j in range(calls)]
    if any([e[0] for e in r] != [e[0] for e in replays[0]] for r in replays):
        raise ValueError("the replays' kernels differ in name or order")
    kernels = [{"kernel": name, "us": sum(r[i][2] - r[i][1] for r in replays) / calls,
                "gap_before_us": None if i == 0 else sum(r[i][1] - r[i - 1][2] for r in replays) / calls}
               for i, (name, _, _) in enumerate(replays[0])]
    return {"span_us": sum(r[-1][2] - r[0][1] for r in replays) / calls,
            "kernel_sum_us": sum(k["us"] for k in kernels), "kernels": kernels}


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
    ap.add_argument("--graph", action="store_true",
                    help="profile replays of the call captured in a CUDA graph: kernels in order, the gaps between "
                         "them, the span and the replay's wall time")
    ap.add_argument("--json", type=Path, help="also write the times here")
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error(f"--calls {args.calls} is invalid; accepted: a positive integer")
    if args.causal and args.no_causal:
        ap.error("--causal and --no-causal together are invalid; accepted: one of them, or neither (both switches)")
    import torch
    import triton
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (it profiles the kernels there); none is visible")
    switches = [False] if args.no_causal else [True] if args.causal else [True, False]
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "calls": args.calls, "mode": "fwd" if args.forward_only else "fwd+bwd", "layout": args.layout,
           "us_per_call": {}}
    if args.graph:
        out["graph"] = {}
    print(f"{out['gpu']}, torch {out['torch']}, triton {out['triton']} ({triton.__file__})")
    for causal in switches:
        for shape in args.shape:
            for provider in args.providers:
                key = f"{'causal' if causal else 'non-causal'} {'x'.join(map(str, shape))} {provider}"
                if args.graph:
                    r = graph_replay(shape, provider, causal, args.forward_only, args.calls, args.layout)
                    out["graph"][key] = r
                    print(f"{key}: replay {r['wall_us']:.1f} µs (events), span {r['span_us']:.1f}, "
                          f"kernels {r['kernel_sum_us']:.1f}")
                    for k in r["kernels"]:
                        gap = "" if k["gap_before_us"] is None else f"(+{k['gap_before_us']:.1f})"
                        print(f"   {k['us']:9.1f} {gap:>8}  {k['kernel'][:110]}")
                    sys.stdout.flush()
                    continue
                times = kernel_times(shape, provider, causal, args.forward_only, args.calls, args.layout)
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
