"""Where a GPT-2 training step's GPU time goes, per attention: the step of `stableflash bench train`
(same model, batch, compile and optimizer), run under torch.profiler, with every CUDA kernel's time
summed per step and grouped (attention, matrix products, copies, the rest).

    python benchmarks/tools/train_profile.py [--attention SPEC ...] [--steps 5] [--out FILE.json]

Prints, per attention, the step's wall time, its summed kernel time, each group's share and the
largest kernels, then the GPU's idle time between kernels summed by the kernel it waited for (a
launch that reached the GPU late); writes the full tables to --out. Answers "is the gap between two attentions
in the attention kernels, or around them?" (bench train gives only the step time).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict

import torch

from stableflash.bench.attention import environment
from stableflash.bench.training import TrainBenchConfig, training_step

GROUPS = (("attention", re.compile(r"attn|flash|fmha|cudnn|sdpa|delta|_bwd_|_fwd_", re.I)),
          ("matmul", re.compile(r"gemm|sm90_xmma|cutlass|nvjet|matmul|mma", re.I)),
          ("copy", re.compile(r"copy|transpose|cat|elementwise_kernel_with_index|CatArray", re.I)))


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if pattern.search(name):
            return group
    return "other"


def profile_attention(spec: str, cfg: TrainBenchConfig, steps: int) -> dict:
    step, _ = training_step(spec, cfg, torch.device("cuda"))
    for _ in range(cfg.warmup):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name]
            k[0] += ev.device_time_total / 1e3 / steps
            k[1] += 1
    idle = idle_before(prof.events(), steps)
    rows = sorted(({"kernel": n, "ms_per_step": t, "calls_per_step": c / steps, "group": group_of(n)}
                   for n, (t, c) in kernels.items()), key=lambda r: -r["ms_per_step"])
    groups = defaultdict(float)
    for r in rows:
        groups[r["group"]] += r["ms_per_step"]
    return {"attention": spec, "wall_ms_per_step": wall_ms, "kernel_ms_per_step": sum(groups.values()),
            "groups": dict(groups), "kernels": rows, **idle}


def idle_before(events, steps: int) -> dict:
    """The GPU's idle time between consecutive kernels (one stream's worth: kernels sorted by start),
    per step, summed by the kernel it waited for: a launch that reaches the GPU late shows as time
    before its kernel. {"idle_ms_per_step", "idle_before": [{"kernel", "group", "ms_per_step",
    "gaps_per_step"}] largest first}."""
    spans = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in events
                   if ev.device_type == torch.autograd.DeviceType.CUDA)
    waited: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    end = None
    for start, stop, name in spans:
        if end is not None and start > end:
            w = waited[name]
            w[0] += (start - end) / 1e3 / steps
            w[1] += 1
        end = stop if end is None else max(end, stop)
    rows = sorted(({"kernel": n, "group": group_of(n), "ms_per_step": t, "gaps_per_step": c / steps}
                   for n, (t, c) in waited.items()), key=lambda r: -r["ms_per_step"])
    return {"idle_ms_per_step": sum(r["ms_per_step"] for r in rows), "idle_before": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attention", action="append", help="attention spec (repeatable; default: sdpa and triton)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("train_profile.py needs a CUDA GPU; none is visible")
    specs = a.attention or ["sdpa", "triton"]
    cfg = TrainBenchConfig(attentions=tuple(specs), batch_size=a.batch_size, compile=not a.no_compile)
    result = {"config": vars(a), "env": environment(), "rows": []}
    for spec in specs:
        r = profile_attention(spec, cfg, a.steps)
        result["rows"].append(r)
        print(f"\n== {spec}: wall {r['wall_ms_per_step']:.2f} ms/step, kernels {r['kernel_ms_per_step']:.2f} ms/step")
        print("   " + ", ".join(f"{g} {t:.2f}" for g, t in sorted(r["groups"].items(), key=lambda kv: -kv[1])))
        for k in r["kernels"][: a.top]:
            print(f"   {k['ms_per_step']:7.3f} ms  {k['calls_per_step']:5.1f}×  [{k['group']}] {k['kernel'][:110]}")
        print(f"   GPU idle between kernels {r['idle_ms_per_step']:.2f} ms/step; the kernels it waited for:")
        for k in r["idle_before"][: a.top]:
            print(f"   {k['ms_per_step']:7.3f} ms  {k['gaps_per_step']:5.1f}×  [{k['group']}] {k['kernel'][:110]}")
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
