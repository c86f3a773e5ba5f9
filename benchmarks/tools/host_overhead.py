"""Host time per attention call: how long the CPU spends to launch one forward, or one forward and
backward, when the GPU work is too small to matter (a 1 × 1 × 128 × 64 causal bf16 call by default).

    python benchmarks/tools/host_overhead.py [--shape 1,1,128,64] [--calls 300] [--json OUT.json] [--profile OUT.txt]
                                             [--breakdown OUT.json]

Per provider: microseconds per call of the forward alone (under ``torch.no_grad``), of forward and
backward in eager mode, and of forward and backward through ``torch.compile`` (``fullgraph``, default
mode). Providers: SDPA as torch picks
it, ``flash_attention`` with ``stabilize=True`` (its kernels launched through
``triton.launch_cache``, and with that cache off: every launch through Triton's own dispatch;
compiled, through the inline ops — torch.compile launches the kernels — and through the opaque
ops, whose Python runs on every call) and with ``stabilize=False``. Then the forward's own parts for ``stabilize=True``: the Python of
``triton.op._forward`` with every kernel launch replaced by a no-op (argument preparation and
allocation alone), with the compiled kernel's launch alone replaced by a no-op (what the launch
cache itself adds: its key, Triton's binder), and with the launches (the rest is the compiled
kernel's launch: Triton's launcher and the driver). Each figure is the wall time of ``--calls``
calls after 20 warm-up calls, divided by the count, the median of 5 repeats; the GPU is
synchronised at the end of each repeat only, so that a call's time is the host's as long as the
queue does not fill. A last provider row has ``_forward`` and ``_backward_impl`` stubbed (outputs
allocated, no kernel): the host time of everything around the kernels' launchers. One pass
measures each provider once: compare rows across passes (the
forward row moved by ±40% between passes of one machine).

--profile: also run each ``stabilize=True`` path (forward, forward and backward, compiled forward and
backward) under cProfile and write the functions with the most own time to the file: where the
host's microseconds go, function by function.

--breakdown: also time the ``stabilize=True`` provider's eager forward and backward by part, without a
profiler: each function of ``BREAKDOWN`` (and of ``LAUNCHER``, Triton's launcher, where the installed triton
has those functions) wrapped so that its inclusive wall time is summed over the calls (nested functions
overlap; each wrapper adds its own microseconds), beside the forward call and ``torch.autograd.grad`` as a
whole; written as JSON, printed as a table. A function the kept plans make unnecessary reads 0.

The training step's profile (``train_profile.py``) shows the time outside kernels per step; this
says which part of one attention call it comes from.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def providers():
    """{name: (function, whether the kernels' launch cache is on, whether torch.compile calls the
    inline ops)}."""
    from stableflash.attention import flash_attention
    stabilized = lambda q, k, v: flash_attention(q, k, v, causal=True)  # noqa: E731
    return {
        "sdpa (torch's pick)": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), True, True),
        "stableflash stabilize=True": (stabilized, True, True),
        "stableflash stabilize=True, opaque ops under torch.compile": (stabilized, True, False),
        "stableflash stabilize=True, every launch through Triton's dispatch": (stabilized, False, True),
        "stableflash stabilize=False": (lambda q, k, v: flash_attention(q, k, v, causal=True, stabilize=False), True,
                                        True),
    }


def inputs(shape: tuple[int, int, int, int]) -> tuple[torch.Tensor, ...]:
    """q, k, v (requiring gradients) and dO, bf16 on the GPU, from a fixed seed."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


# each timed path and the row's key for it
PATHS = {"forward": "forward_us", "forward + backward": "forward_backward_us",
         "compiled forward + backward": "compiled_forward_backward_us"}


def paths(fn, q, k, v, do) -> dict:
    """{path name: one call}: ``fn``'s forward under no_grad, its forward and backward, and both
    through ``torch.compile(fullgraph=True)``."""
    compiled = torch.compile(fn, fullgraph=True)

    def forward():
        with torch.no_grad():
            fn(q, k, v)

    return {"forward": forward, "forward + backward": lambda: fn(q, k, v).backward(do),
            "compiled forward + backward": lambda: compiled(q, k, v).backward(do)}


def measure(shape: tuple[int, int, int, int], calls: int) -> list[dict]:
    from stableflash.attention.triton import launch_cache, op
    q, k, v, do = inputs(shape)

    def row(name: str, fn) -> dict:
        timed = paths(fn, q, k, v, do)
        return {"provider": name, **{PATHS[path]: per_call_us(call, calls) for path, call in timed.items()}}

    rows = []
    for name, (fn, cached, inline) in providers().items():
        with mock.patch.object(launch_cache, "ENABLED", cached), mock.patch.object(op, "INLINE_OPS", inline):
            rows.append(row(name, fn))
    with kernels_stubbed():
        rows.append(row("stableflash stabilize=True, _forward and _backward_impl stubbed",
                        providers()["stableflash stabilize=True"][0]))
    rows.append(forward_parts(q, k, v, calls))
    return rows


def kernels_stubbed():
    """``triton.op._forward`` and ``_backward_impl`` replaced by functions that only allocate their
    outputs (the same shapes, dtypes and layouts), as a context manager: what is left of a call is
    the API, the autograd function or custom op around the kernels, and torch.compile's wrappers."""
    from stableflash.attention.triton import op

    def forward(q, k, v, causal, scale, config, masks=op.Masks(), drop_seed=0):
        o32 = torch.empty(q.shape if config.delta.keeps_o else (0,),
                          dtype=q.dtype if config.delta.residual else torch.float32, device=q.device)
        return op._empty_like_layout(q), torch.empty(q.shape[:3], device=q.device), o32

    def backward(do, q, k, v, o, residual, lse, causal, scale, config, masks=op.Masks(), seed=0):
        return op._empty_like_layout(q), op._empty_like_layout(k), op._empty_like_layout(k)

    return mock.patch.multiple(op, _forward=forward, _backward_impl=backward)


def profile_paths(shape: tuple[int, int, int, int], calls: int, top: int = 25) -> str:
    """cProfile of the ``stabilize=True`` paths, ``top`` functions by own time each, as text."""
    import cProfile
    import io
    import pstats
    fn, *_ = providers()["stableflash stabilize=True"]
    out = io.StringIO()
    for name, path in paths(fn, *inputs(shape)).items():
        for _ in range(20):
            path()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            path()
        torch.cuda.synchronize()
        prof.disable()
        out.write(f"== {name}, {calls} calls (times per call: divide by {calls})\n")
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def forward_parts(q, k, v, calls: int) -> dict:
    """``_forward``'s host time for the ``stabilize=True`` configuration, without and with its launches."""
    from stableflash.attention.triton import launch_cache, op
    from stableflash.attention.triton.launch import stabilized_config
    config = stabilized_config(torch.bfloat16)
    scale = q.shape[-1] ** -0.5
    qd, kd, vd = (t.detach() for t in (q, k, v))

    def forward():
        op._forward(qd, kd, vd, True, scale, config)

    with_launch = per_call_us(forward, calls)
    with mock.patch.object(op, "_launch", lambda *a, **kw: None):
        without = per_call_us(forward, calls)
    # the launch cache's work with the driver call stubbed: each recorded kernel launches nothing
    with mock.patch.dict(launch_cache._kernels, {key: _NoLaunch() for key in launch_cache._kernels}), \
            mock.patch.dict(launch_cache._calls, {key: dataclasses.replace(call, kernel=_NoLaunch())
                                                  for key, call in launch_cache._calls.items()}):
        without_driver = per_call_us(forward, calls)
    return {"provider": "triton.op._forward (stabilize=True)", "forward_us": with_launch,
            "forward_without_launch_us": without, "forward_without_driver_launch_us": without_driver}


# --breakdown's functions, (module, attribute; a class's static method as "Class.method"), outermost first
BREAKDOWN = [("stableflash.attention.api", "attend"),
             ("stableflash.attention.triton.op", "_EagerAttention.forward"),
             ("stableflash.attention.triton.op", "_forward"),
             ("stableflash.attention.gluon.route", "why_not"),
             ("stableflash.attention.gluon.route", "forward"),
             ("stableflash.attention.triton.op", "_EagerAttention.backward"),
             ("stableflash.attention.triton.op", "_backward_impl"),
             ("stableflash.attention.gluon.route", "why_not_backward"),
             ("stableflash.attention.gluon.route", "backward"),
             ("stableflash.attention.gluon.launch_backward", "launch_args_backward"),
             ("stableflash.attention.gluon.launch_backward", "_delta"),
             ("stableflash.attention.triton.op", "_empty_like_layout"),
             ("stableflash.attention.triton.launch_cache", "launch"),
             ("stableflash.attention.triton.launch_cache", "call_key"),
             ("stableflash.attention.triton.launch_cache", "_bind"),
             # a repeated call's path: its kept plan, looked up and replayed
             ("stableflash.attention.gluon.launch_backward", "replay"),
             ("stableflash.attention.triton.launch_cache", "plan_key"),
             ("stableflash.attention.triton.launch_cache", "Plan.__call__"),
             ("stableflash.attention.triton.launch_cache", "Plan.allocate"),
             ("stableflash.attention.triton.launch_cache", "Replay.__call__")]
# and Triton's own launcher where the installed triton has it (its module layout is not an API)
LAUNCHER = [("triton.backends.nvidia.driver", "CudaLauncher.__call__"),
            ("triton.backends.nvidia.driver", "make_tensordesc_arg")]


def _owner(module_name: str, attribute: str) -> tuple[object, str]:
    """(the object holding ``attribute``, a dotted path from the module, and its last name); ImportError or
    AttributeError where the module or a part of the path is missing."""
    owner = importlib.import_module(module_name)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


@contextlib.contextmanager
def summed(targets, sums: dict):
    """Within the block each (module, attribute) of ``targets`` adds its inclusive wall time in seconds
    to ``sums[attribute]`` on every call; the originals are put back after."""
    restore = []
    try:
        for module_name, attribute in targets:
            owner, name = _owner(module_name, attribute)
            original = owner.__dict__[name]
            static = isinstance(original, staticmethod)
            fn = original.__func__ if static else original

            def timed(*args, _fn=fn, _key=attribute, **kwargs):
                start = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    sums[_key] += time.perf_counter() - start

            setattr(owner, name, staticmethod(timed) if static else timed)
            restore.append((owner, name, original))
        yield sums
    finally:
        for owner, name, original in reversed(restore):
            setattr(owner, name, original)


def breakdown(forward, backward, calls: int, targets=BREAKDOWN) -> dict[str, float]:
    """Microseconds per call: ``forward()`` (which returns the output), ``backward(output)``, and each
    target's inclusive time within them, over ``calls`` pairs after 20 warm-up pairs outside the timing."""
    for _ in range(20):
        backward(forward())
    sums = collections.defaultdict(float)
    with summed(targets, sums):
        for _ in range(calls):
            start = time.perf_counter()
            out = forward()
            middle = time.perf_counter()
            backward(out)
            sums["forward call"] += middle - start
            sums["torch.autograd.grad"] += time.perf_counter() - middle
    order = ["forward call", "torch.autograd.grad", *(attribute for _, attribute in targets)]
    return {name: sums[name] / calls * 1e6 for name in order}


def _resolves(module_name: str, attribute: str) -> bool:
    """Whether ``attribute`` (a dotted path from the module) exists in the importable ``module_name``."""
    try:
        owner, name = _owner(module_name, attribute)
    except (ImportError, AttributeError):
        return False
    return name in getattr(owner, "__dict__", {})


def stabilized_breakdown(shape: tuple[int, int, int, int], calls: int) -> dict[str, float]:
    """``breakdown`` of the ``stabilize=True`` provider's eager forward and ``torch.autograd.grad``."""
    fn, *_ = providers()["stableflash stabilize=True"]
    q, k, v, do = inputs(shape)
    targets = BREAKDOWN + [t for t in LAUNCHER if _resolves(*t)]
    result = breakdown(lambda: fn(q, k, v), lambda o: torch.autograd.grad(o, (q, k, v), do), calls, targets)
    torch.cuda.synchronize()
    return result


class _NoLaunch:
    """A recorded kernel whose launch does nothing: what is left is the launch cache's own work."""

    def __getitem__(self, grid):
        return lambda *args: None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1,1,128,64", help="B,H,N,d (default: %(default)s)")
    ap.add_argument("--calls", type=int, default=300, help="calls per repeat (default: %(default)s)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--profile", type=Path, help="also write a cProfile of the stabilize=True paths here")
    ap.add_argument("--breakdown", type=Path, help="also write the stabilize=True eager call's time by part here")
    args = ap.parse_args(argv)
    try:
        shape = tuple(int(x) for x in args.shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        ap.error(f"--shape {args.shape!r} is invalid; accepted: four integers B,H,N,d, each at least 1")
    if args.calls < 1:
        ap.error(f"--calls {args.calls} is invalid; accepted: an integer of at least 1")
    if not torch.cuda.is_available():
        print("host_overhead.py needs a CUDA device", file=sys.stderr)
        return 1
    rows = measure(shape, args.calls)
    import triton
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"shape {args.shape}, causal bf16; microseconds per call (host-bound)")
    print("| provider | forward | forward + backward | compiled forward + backward | forward, launches stubbed | "
          "forward, driver call stubbed |")
    print("|---|---|---|---|---|---|")
    cell = lambda r, key: f"{r[key]:.1f}" if key in r else "—"  # noqa: E731
    for r in rows:
        print(f"| {r['provider']} | {cell(r, 'forward_us')} | {cell(r, 'forward_backward_us')} | "
              f"{cell(r, 'compiled_forward_backward_us')} | {cell(r, 'forward_without_launch_us')} | "
              f"{cell(r, 'forward_without_driver_launch_us')} |")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "triton": triton.__version__, "shape": shape, "rows": rows}, indent=1) + "\n")
    if args.profile:                                        # after the table: a failure here keeps the rows
        args.profile.write_text(profile_paths(shape, args.calls))
    if args.breakdown:
        parts = stabilized_breakdown(shape, args.calls)
        print("| stabilize=True, eager, inclusive (nested parts overlap) | µs per call |\n|---|---|")
        for name, us in parts.items():
            print(f"| {name} | {us:.1f} |")
        args.breakdown.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "triton": triton.__version__, "shape": shape, "calls": args.calls,
                                              "us_per_call": parts}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
