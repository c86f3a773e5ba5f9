"""Memory each attention variant keeps for its backward: the bytes of the tensors autograd saves in
one forward (unique storages, the inputs q, k, v left out) plus the output, per element of O, at
each shape; on CUDA also the allocator's growth across the forward as a cross-check.
What `delta=dO·O32` (an fp32 copy of O beside the bf16 one) or `out=fp32` costs in memory.

    python benchmarks/tools/saved_memory.py [--providers stableflash stableflash-none-o32c ...] [--shape B,H,N,d ...]
        [--json OUT.json]
On a machine without CUDA run it with TRITON_INTERPRET=1 and a small --shape.
"""
import argparse
import json

import torch

from stableflash.bench.attention import provider_fn, provider_name, saved_for_backward


def saved_bytes(name: str, shape, device) -> dict:
    q, k, v = (torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fn = provider_fn(name, shape, True, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    o, kept = saved_for_backward(lambda q, k, v: fn(q, k, v, True), q, k, v)
    row = {"provider": name, "shape": list(shape), "saved_bytes": kept + o.untyped_storage().nbytes()}
    row["bytes_per_element_of_O"] = row["saved_bytes"] / o.numel()
    if cuda:
        torch.cuda.synchronize()
        row["allocator_growth_bytes"] = torch.cuda.memory_allocated() - before
    del o
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--providers", nargs="+", default=["stableflash-none", "stableflash", "stableflash-tie-shift-o32c",
                                                        "stableflash-tie-shift-o32r", "stableflash-tie-shift-o32",
                                                        "stableflash-tie-shift-fp8", "stableflash-tie-shift-fp8-o16",
                                                        "sdpa-flash"], type=provider_name)
    ap.add_argument("--shape", action="append", help="B,H,N,d (repeatable; default 8,16,4096,64)")
    ap.add_argument("--json")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in (args.shape or ["8,16,4096,64"])]
    for s in shapes:
        if len(s) != 4 or min(s) < 1:
            raise SystemExit(f"--shape {s} is invalid; accepted: four positive ints B,H,N,d")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [saved_bytes(p, s, device) for s in shapes for p in args.providers]
    print(f"{'provider':16s} {'shape':>16s} {'saved MiB':>10s} {'bytes/elem of O':>16s} {'allocator MiB':>14s}")
    for r in rows:
        grow = r.get("allocator_growth_bytes")
        print(f"{r['provider']:16s} {'x'.join(map(str, r['shape'])):>16s} {r['saved_bytes'] / 2**20:10.1f} "
              f"{r['bytes_per_element_of_O']:16.2f} {'-' if grow is None else f'{grow / 2**20:.1f}':>14s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
