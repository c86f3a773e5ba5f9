"""Hardware counters of the attention kernels: ours (the packed call the GPT model makes, `stabilize=True`)
and cuDNN's (torch's default SDPA on Hopper), one causal forward + backward each, read by Nsight Compute.

    ncu --profile-from-start off --clock-control none --set full -o REPORT \
        python benchmarks/tools/ncu_attention.py run [--shape 16,12,1024,64] [--fwd-tile 64,64,4,3] [--no-causal]
    ncu --import REPORT.ncu-rep --page raw --csv > RAW.csv
    python benchmarks/tools/ncu_attention.py table RAW.csv [RAW2.csv ...]

    ncu --profile-from-start off --clock-control none --set full --import-source yes -o REPORT \
        python benchmarks/tools/ncu_attention.py forward --provider triton|cudnn|gluon-TILES [--shape ...]
    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > SOURCE.csv
    python benchmarks/tools/ncu_attention.py source SOURCE.csv [--top 12]

``run`` warms both calls up (the Triton tuners pick their tiles there, and print them as
``CHOICES``), then profiles exactly one call of each (causal unless ``--no-causal``) between ``cudaProfilerStart`` and
``cudaProfilerStop``; ``--fwd-tile BLOCK_M,BLOCK_N,WARPS,STAGES`` gives the forward's tuner that one
tile (pointer loads) instead of its list. ``table`` prints, per attention kernel of a raw CSV
export: time, warp instructions issued, issue-slot and warp occupancy, registers and the programs
a multiprocessor holds, the busiest pipes and the largest stall reasons per issued instruction.

``forward`` profiles one forward (causal unless ``--no-causal``) of one provider after five warm-up
calls: the Triton forward as ``stabilize=True`` runs it ("triton"), cuDNN's ("cudnn"), or the Gluon
Hopper forward at tiles named as ``benchmarks/tools/gluon_forward_check.py --tiles`` names them
("gluon-128x128x3p", "gluon-64x64x3n").
``source`` reads a per-instruction export (``--page source --print-source sass``) and prints, per
kernel: the executed warp instructions by opcode; the stall samples of the hot loops (instructions
executed at least half as often as the most executed one) and of the rest, by reason; and the
instructions with the most samples. Warps that only wait at a barrier (a warp-specialised kernel's
idle producer warps) show up under "rest" as barrier samples without costing the computing warps
issue slots.
"""
from __future__ import annotations

import argparse
import collections
import csv
import json
import re
import sys
from pathlib import Path

KERNELS = (("attn_fwd_kernel", "ours fwd"), ("attn_fwd_hopper_kernel", "Gluon fwd"),
           ("attn_bwd_dkdv_hopper_kernel", "Gluon dK/dV"), ("attn_bwd_dq_hopper_kernel", "Gluon dQ"),
           ("attn_bwd_hopper_kernel", "Gluon bwd (atomic dQ)"), ("scale_dq_kernel", "Gluon dQ scaling"),
           ("attn_bwd_dkdv_kernel", "ours dK/dV"), ("attn_bwd_dq_kernel", "ours dQ"), ("delta", "ours δ"),
           ("flash_fprop", "cuDNN fprop"), ("flash_bprop", "cuDNN bprop"), ("dot_do_o", "cuDNN δ"),
           ("convert_dq", "cuDNN dQ convert"))
PIPES = ("tensor_op_gmma", "tensor_op_hmma", "alu", "fma", "xu", "lsu", "uniform", "adu")
TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
STALL = re.compile(r"smsp__average_warps?_issue_stalled_(\w+)_per_issue_active\.ratio$")


def label(name: str) -> str | None:
    """The short name of an attention kernel (``KERNELS``), None for any other kernel."""
    for key, short in KERNELS:
        if key in name:
            return short
    return None


def _num(value: str) -> float:
    try:
        return float(value.replace(",", ""))
    except ValueError:
        return float("nan")


def summarize(path: str) -> list[dict]:
    """One dict per attention kernel in a raw CSV export (header row, units row, one row per kernel)."""
    try:
        rows = list(csv.reader(open(path, newline="")))
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror}); expected an `ncu --page raw --csv` export") from None
    if len(rows) < 3:
        raise ValueError(f"{path}: no kernel rows (expected an `ncu --page raw --csv` export)")
    head, data = rows[0], rows[2:]
    at = {h: i for i, h in enumerate(head)}
    missing = [m for m in ("Kernel Name", "gpu__time_duration.sum", "smsp__inst_executed.sum") if m not in at]
    if missing:
        raise ValueError(f"{path}: columns {missing} missing (export with --page raw --set full)")
    unit = rows[1][at["gpu__time_duration.sum"]].strip()
    if unit not in TIME_UNITS:
        raise ValueError(f"{path}: gpu__time_duration.sum in {unit!r}; accepted: {', '.join(TIME_UNITS)}")
    to_us = TIME_UNITS[unit]
    out = []
    for r in data:
        short = label(r[at["Kernel Name"]])
        if short is None:
            continue

        def get(metric):
            return _num(r[at[metric]]) if metric in at else float("nan")
        pipes = {p: get(f"sm__inst_executed_pipe_{p}.avg.pct_of_peak_sustained_active") for p in PIPES}
        stalls = {m.group(1): _num(r[i]) for h, i in at.items() if (m := STALL.match(h))}
        out.append({
            "kernel": short, "us": get("gpu__time_duration.sum") * to_us,
            "warp_instructions_M": get("smsp__inst_executed.sum") / 1e6,
            "issue_active_pct": get("smsp__issue_active.avg.pct_of_peak_sustained_active"),
            "warps_active_pct": get("sm__warps_active.avg.pct_of_peak_sustained_active"),
            "registers": get("launch__registers_per_thread"),
            "programs_per_sm": min(get("launch__occupancy_limit_registers"), get("launch__occupancy_limit_shared_mem")),
            "threads": get("launch__block_size"), "grid": get("launch__grid_size"),
            "pipes_pct": {p: v for p, v in pipes.items() if v == v},
            "stalls_per_issue": dict(sorted(((k, v) for k, v in stalls.items() if v == v),
                                            key=lambda kv: -kv[1])[:5]),
        })
    return out


def table(paths: list[str]) -> None:
    for path in paths:
        print(f"== {path}")
        print(f"{'kernel':18s} {'µs':>8s} {'Minst':>7s} {'issue%':>6s} {'warps%':>6s} {'regs':>4s} "
              f"{'prog/SM':>7s} {'thr':>4s} {'grid':>6s}  busiest pipes (% of peak) | stalls per issue")
        for k in summarize(path):
            pipes = ", ".join(f"{p} {v:.0f}" for p, v in sorted(k["pipes_pct"].items(), key=lambda kv: -kv[1])[:4])
            stalls = ", ".join(f"{s} {v:.2f}" for s, v in k["stalls_per_issue"].items())
            print(f"{k['kernel']:18s} {k['us']:8.1f} {k['warp_instructions_M']:7.1f} {k['issue_active_pct']:6.1f} "
                  f"{k['warps_active_pct']:6.1f} {k['registers']:4.0f} {k['programs_per_sm']:7.0f} {k['threads']:4.0f} "
                  f"{k['grid']:6.0f}  {pipes} | {stalls}")


def run(shape: tuple[int, int, int, int], fwd_tile: tuple[int, int, int, int] | None, causal: bool = True) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import stableflash as sf
    from stableflash.attention.triton import op
    if not torch.cuda.is_available():
        raise ValueError("run needs a CUDA GPU (it profiles the kernels there); none is visible")
    if fwd_tile:
        op.TUNERS["fwd"].configs = [op._cfg(*fwd_tile)]
        op.TUNERS["fwd_tma"].configs = [op._cfg(*fwd_tile, TMA=False)]
    B, H, N, D = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(B, N, 3, H, D, device="cuda", generator=gen).bfloat16().requires_grad_()
    do = torch.randn(B, N, H, D, device="cuda", generator=gen).bfloat16()

    def ours():
        sf.flash_attn_qkvpacked_func(qkv, causal=causal).backward(do)

    def cudnn():
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(do.transpose(1, 2))
    _profile_once(ours, cudnn, before=lambda: print("CHOICES", json.dumps(op.tuned_choices())))


def _profile_once(*calls, before=None) -> None:
    """Each call five times (the tuners pick their tiles there), then ``before``, then exactly one call of
    each between ``cudaProfilerStart`` and ``cudaProfilerStop`` (what ``--profile-from-start off`` records)."""
    import torch
    for _ in range(5):
        for call in calls:
            call()
    torch.cuda.synchronize()
    if before is not None:
        before()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def source_kernels(path: str) -> list[dict]:
    """Per kernel of a ``--page source --csv --print-source sass`` export: name, opcode → executed warp
    instructions, and per instruction (source text, executions, stall samples by reason)."""
    try:
        rows = list(csv.reader(open(path, newline="")))
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror}); expected an `ncu --page source --csv "
                         f"--print-source sass` export") from None
    starts = [i for i, r in enumerate(rows) if r[:1] == ["Kernel Name"]]
    if not starts:
        raise ValueError(f"{path}: no 'Kernel Name' row (expected an `ncu --page source --csv --print-source sass` "
                         f"export)")
    out = []
    for n, i in enumerate(starts):
        head, body = rows[i + 1], rows[i + 2:starts[n + 1] if n + 1 < len(starts) else len(rows)]
        at = {h: k for k, h in enumerate(head)}
        need = ("Source", "Instructions Executed", "Warp Stall Sampling (All Samples)")
        if any(m not in at for m in need):
            raise ValueError(f"{path}: columns {[m for m in need if m not in at]} missing for kernel {rows[i][1]!r}")
        reasons = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
        instructions, ops = [], collections.Counter()
        for r in body:
            if len(r) != len(head):
                continue
            text = r[at["Source"]].strip()
            executed = int(_num(r[at["Instructions Executed"]]) or 0)
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split(" ")[0].split(".")[0] or "?"
            ops[op] += executed
            instructions.append({"index": len(instructions), "text": text, "executed": executed,
                                 "samples": int(_num(r[at["Warp Stall Sampling (All Samples)"]]) or 0),
                                 "stalls": {h[len("stall_"):]: int(_num(r[at[h]]) or 0) for h in reasons}})
        out.append({"kernel": rows[i][1], "opcodes": ops, "instructions": instructions})
    return out


def source_table(paths: list[str], top: int = 12) -> None:
    for path in paths:
        for k in source_kernels(path):
            ins = k["instructions"]
            total = sum(k["opcodes"].values())
            samples = sum(x["samples"] for x in ins) or 1
            hot = max((x["executed"] for x in ins), default=0) / 2
            print(f"== {Path(path).name}: {k['kernel'][:70]}")
            print(f"   {total / 1e6:.1f} M warp instructions executed; by opcode: " + ", ".join(
                f"{op} {n / total * 100:.1f}%" for op, n in k["opcodes"].most_common(top)))
            for part, sel in (("hot loops", lambda x: x["executed"] >= hot), ("rest", lambda x: x["executed"] < hot)):
                chosen = [x for x in ins if sel(x)]
                got = sum(x["samples"] for x in chosen) or 1
                why = collections.Counter()
                for x in chosen:
                    why.update(x["stalls"])
                print(f"   {part}: {len(chosen)} instructions, {sum(x['executed'] for x in chosen) / 1e6:.1f} M executed, "
                      f"{got / samples * 100:.1f}% of samples; " + ", ".join(
                          f"{r} {v / got * 100:.0f}%" for r, v in why.most_common(6)))
            print("   most sampled instructions (index, executions, % of samples, top reasons):")
            for x in sorted(ins, key=lambda x: -x["samples"])[:top]:
                why = ", ".join(f"{r} {v}" for r, v in sorted(x["stalls"].items(), key=lambda kv: -kv[1])[:2] if v)
                print(f"   #{x['index']:<5d} {x['executed']:>9d} {x['samples'] / samples * 100:5.1f}%  "
                      f"{x['text'][:58]:58s} {why}")


# --provider → the name gluon_forward_check.providers gives it
FORWARD_PROVIDERS = {"triton": "triton-stabilized", "cudnn": "sdpa-cudnn"}


def forward(provider: str, shape: tuple[int, int, int, int], causal: bool = True) -> None:
    """One forward (causal unless ``causal`` is False) of ``provider``, built by
    ``gluon_forward_check.providers`` (the Triton forward as ``stabilize=True`` runs it, cuDNN's, or the
    Gluon forward at the named tiles), profiled once."""
    if provider not in FORWARD_PROVIDERS and not provider.startswith("gluon-"):
        raise ValueError(f"--provider {provider!r}: accepted: triton, cudnn, gluon-TILES (e.g. gluon-128x128x3p)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gluon_forward_check as check
    import torch
    try:
        tiles = [check.parse_tiles(provider[len("gluon-"):])] if provider.startswith("gluon-") else []
    except ValueError as e:
        raise ValueError(f"--provider {provider!r}: gluon-TILES with TILES {e}") from None
    if not torch.cuda.is_available():
        raise ValueError("forward needs a CUDA GPU (it profiles the kernel there); none is visible")
    B, H, N, D = shape
    fn = check.providers(D, causal, tiles)[FORWARD_PROVIDERS.get(provider) or check.tiles_name(*tiles)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=gen).bfloat16() for _ in range(3))
    with torch.no_grad():
        _profile_once(lambda: fn(q, k, v))


def _ints(text: str, n: int, name: str) -> tuple[int, ...]:
    parts = text.split(",")
    if len(parts) != n or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{name} {text!r}: expected {n} positive integers separated by commas")
    return tuple(int(p) for p in parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the profiled program (start it under ncu)")
    r.add_argument("--shape", type=lambda s: _ints(s, 4, "--shape"), default=(16, 12, 1024, 64),
                   help="B,H,N,head_dim (default 16,12,1024,64: GPT-2 small at batch 16)")
    r.add_argument("--fwd-tile", type=lambda s: _ints(s, 4, "--fwd-tile"), default=None,
                   help="BLOCK_M,BLOCK_N,WARPS,STAGES: the forward's only tile")
    r.add_argument("--no-causal", action="store_true", help="non-causal attention (default: causal)")
    t = sub.add_parser("table", help="summarize `ncu --page raw --csv` exports")
    t.add_argument("csv", nargs="+")
    f = sub.add_parser("forward", help="the profiled program for one provider's forward (start it under ncu)")
    f.add_argument("--no-causal", action="store_true", help="non-causal attention (default: causal)")
    f.add_argument("--provider", required=True, help="triton, cudnn or gluon-TILES (e.g. gluon-128x128x3p)")
    f.add_argument("--shape", type=lambda s: _ints(s, 4, "--shape"), default=(16, 12, 1024, 64),
                   help="B,H,N,head_dim (default 16,12,1024,64)")
    so = sub.add_parser("source", help="summarize `ncu --page source --csv --print-source sass` exports")
    so.add_argument("csv", nargs="+")
    so.add_argument("--top", type=int, default=12, help="opcodes and instructions listed per kernel (default 12)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "run":
            run(args.shape, args.fwd_tile, not args.no_causal)
        elif args.cmd == "forward":
            forward(args.provider, args.shape, not args.no_causal)
        elif args.cmd == "source":
            source_table(args.csv, args.top)
        else:
            table(args.csv)
    except ValueError as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
