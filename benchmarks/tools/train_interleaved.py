"""A training step's speed against SDPA's where the host decides it: the steps of several attentions
interleaved one at a time in one process, so that the host's drift between processes cancels.

    python benchmarks/tools/train_interleaved.py [--attention SPEC ...] [--batch-size 4] [--no-compile]
        [--compile-mode default] [--rounds 60] [--without-plans] [--without-graphs] [--without-route] [--forward-min-keys N]
        [--host-parts] [--json OUT.json]

``stableflash bench train`` times each attention in turn, and at small batches, where a step waits for
the host, the same command gives ratios tens of percent apart from process to process (the host's
speed drifts over seconds). Here the models of every case are built (the step of ``bench train``: same
model, optimizer, compile and data) and warmed up first; then each round runs one step of every case in
turn, each synchronised before and after: its wall time and the host's time to issue it. The order of
the cases turns by one each round, so that each case takes each place in the round equally often (a
step's time can depend on the step before it). Per case: the
median step, the median host issue time and its split into the forward, the backward and the clipping
and optimizer step after them, and the first case's step over the case's own in the same round — its
median and quartiles (above 1: faster than the first). ``--without-plans`` adds one more case:
the last attention with the Gluon route's launch plans off (``launch_cache.PLANS``), the launches
built on every call; ``--without-graphs`` the last attention with the plans' CUDA graphs off
(``launch_cache.GRAPHS``), each plan's kernels launched one by one. ``--without-route`` adds the last attention with the Gluon route off
(``route.ENABLED``, while its model is compiled and while it steps): every call on the Triton kernels,
which torch.compile launches itself; torch's AOT autograd cache is switched off for the process, since
it would hand that model the graph traced with the route on (the route's choice is not in its key).
``--forward-min-keys N`` adds the last attention with the Gluon forward taking head_dim 64 under a causal
mask from N keys (``route.FORWARD_MIN_KEYS[(64, True)]``, while its model is compiled and while it steps;
the AOT autograd cache off as for ``--without-route``): a route threshold timed on the training step.
``--host-parts`` adds two models of the last attention, built and warmed up as the others, whose steps
run with parts of the attention ops stood in for — "launches stood in for": every launch a plan replays
does nothing (its arguments are still built; the plans' graphs off); "op bodies stood in for": the ops'
bodies ``_forward`` and ``_backward_impl`` only allocate their outputs (``host_overhead.kernels_stubbed``)
— so that their host issue times, against the last attention's, say how
much of it is the launches and how much the bodies' Python; their step times and ratios are not a
training step's (no attention kernels run, and their models train on garbage).
Prints a table; ``--json`` writes it with every round's times, the GPU and the versions. Needs a CUDA
GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

from stableflash.bench.rounds import round_order
from stableflash.bench.training import COMPILE_MODES, TrainBenchConfig


def paired_summary(walls: dict[str, list[float]], issues: dict[str, list[float]],
                   phases: dict[str, list[list[float]]] | None = None) -> dict[str, dict]:
    """Per case (the first one the reference): its median step and host issue time (ms), the reference's
    step over its own in each round — that ratio's median and quartiles — and, given ``phases`` (each
    round's issue time by phase, ``PHASES``), each phase's median."""
    first, *_ = walls
    out = {}
    for case, times in walls.items():
        ratios = [a / b for a, b in zip(walls[first], times)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        out[case] = {"median_ms": statistics.median(times), "issue_median_ms": statistics.median(issues[case]),
                     "paired_ratio_median": statistics.median(ratios), "paired_ratio_quartiles": [q1, q3]}
        if phases is not None:
            out[case]["issue_phase_medians_ms"] = dict(zip(PHASES, (statistics.median(p) for p in zip(*phases[case]))))
    return out


# the phases of a step's host issue time that ``run_rounds`` records
PHASES = ("forward", "backward", "clip and optimizer")


@contextlib.contextmanager
def route_settings(overrides: dict):
    """Within the block, the Gluon route's module attributes named in ``overrides`` hold the given values."""
    from stableflash.attention.gluon import route
    was = {name: getattr(route, name) for name in overrides}
    try:
        for name, value in overrides.items():
            setattr(route, name, value)
        yield
    finally:
        for name, value in was.items():
            setattr(route, name, value)


# the ``--host-parts`` cases: what each stands in for, and its name in the table
STAND_INS = {"launches": "launches stood in for", "bodies": "op bodies stood in for"}


def stood_in(kind: str | None) -> contextlib.AbstractContextManager:
    """Within the block, with ``kind`` "launches": every launch a plan replays does nothing (its arguments
    still built, ``Replay.values``); "bodies": ``op._forward`` and ``op._backward_impl`` only allocate their
    outputs (``host_overhead.kernels_stubbed``); None: nothing stood in for."""
    from unittest import mock
    if kind is None:
        return contextlib.nullcontext()
    if kind == "launches":
        from stableflash.attention.triton import launch_cache
        return mock.patch.object(launch_cache.Replay, "__call__",
                                 lambda self, grid, tensors, stream=None: self.values(tensors))
    here = str(Path(__file__).resolve().parent)                   # this folder's host_overhead.py
    if here not in sys.path:
        sys.path.insert(0, here)
    from host_overhead import kernels_stubbed
    return kernels_stubbed()


class Case(NamedTuple):
    """One case of the rounds: its training step and what it runs under."""
    step: Callable[..., object]          # ``training_step``'s step(marks)
    plans: bool = True                   # launch_cache.PLANS
    graphs: bool = True                  # launch_cache.GRAPHS
    settings: dict = {}                  # the Gluon route's module attributes (``route_settings``)
    stand_in: str | None = None          # ``stood_in``'s kind


def build_steps(specs: list[str], cfg: TrainBenchConfig, without_plans: bool,
                without_route: bool = False, forward_min_keys: int | None = None,
                without_graphs: bool = False, host_parts: bool = False) -> dict[str, Case]:
    """case name → ``Case``: each attention's training step, warmed up (``cfg.warmup`` steps); with ``without_plans`` the last one's again as "<spec>, plans off",
    with ``without_graphs`` as "<spec>, graphs off"; with ``host_parts`` two more models of the last attention
    stepped with ``stood_in`` "launches" and "bodies"; with
    ``without_route`` the last attention's model built again with the route off, "<spec>, route off";
    with ``forward_min_keys`` N built again with the Gluon forward at head_dim 64 causal from N keys,
    "<spec>, forward routed from N keys"."""
    import torch

    from stableflash.attention.gluon import route
    from stableflash.bench.training import training_step

    def built(spec: str, settings: dict):
        with route_settings(settings):
            step, _ = training_step(spec, cfg, torch.device("cuda"))
            for _ in range(cfg.warmup):
                step()
        return step

    steps = {spec: Case(built(spec, {})) for spec in specs}
    last = steps[specs[-1]].step
    if without_plans:
        steps[f"{specs[-1]}, plans off"] = Case(last, plans=False)
    if without_graphs:
        steps[f"{specs[-1]}, graphs off"] = Case(last, graphs=False)
    if host_parts:
        for kind, name in STAND_INS.items():    # the launches' case with graphs off: its plans launch one by one
            steps[f"{specs[-1]}, {name}"] = Case(built(specs[-1], {}), graphs=kind != "launches", stand_in=kind)
    if without_route or forward_min_keys is not None:
        torch._functorch.config.enable_autograd_cache = False
    if without_route:
        off = {"ENABLED": False}
        steps[f"{specs[-1]}, route off"] = Case(built(specs[-1], off), settings=off)
    if forward_min_keys is not None:
        earlier = {"FORWARD_MIN_KEYS": {**route.FORWARD_MIN_KEYS, (64, True): forward_min_keys}}
        steps[f"{specs[-1]}, forward routed from {forward_min_keys} keys"] = Case(built(specs[-1], earlier),
                                                                                  settings=earlier)
    torch.cuda.synchronize()
    return steps


def run_rounds(steps: dict[str, Case], rounds: int) -> tuple[dict, dict, dict]:
    """(wall ms, host issue ms, host issue ms by phase) per case and round: one step of every case per
    round, in the order ``round_order`` gives that round, each under its plans and graphs switches, route
    settings and stand-in. The phases (``PHASES``): the host's issue of the forward, of the backward, and of
    the clipping and optimizer step after it (``training_step``'s marks)."""
    import torch
    from tqdm import tqdm

    from stableflash.attention.triton import launch_cache
    walls = {case: [] for case in steps}
    issues = {case: [] for case in steps}
    phases = {case: [] for case in steps}
    was = launch_cache.PLANS, launch_cache.GRAPHS
    try:
        for index in tqdm(range(rounds), desc="rounds", unit="round"):
            for case in round_order(list(steps), index):
                step, plans, graphs, settings, stand_in = steps[case]
                launch_cache.PLANS, launch_cache.GRAPHS = plans, graphs
                with route_settings(settings), stood_in(stand_in):
                    torch.cuda.synchronize()
                    marks = []
                    t0 = time.perf_counter()
                    step(marks)
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                walls[case].append((t2 - t0) * 1e3)
                issues[case].append((t1 - t0) * 1e3)
                forward, backward = marks
                phases[case].append([(forward - t0) * 1e3, (backward - forward) * 1e3, (t1 - backward) * 1e3])
    finally:
        launch_cache.PLANS, launch_cache.GRAPHS = was
    return walls, issues, phases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attention", action="append",
                    help="attention spec, repeatable; the first is the reference (default: sdpa, then triton)")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per step (default 4)")
    ap.add_argument("--no-compile", action="store_true", help="eager steps (default: torch.compile)")
    ap.add_argument("--compile-mode", default="default", help=f"one of {', '.join(COMPILE_MODES)} (default: default)")
    ap.add_argument("--rounds", type=int, default=60, help="rounds of one step of every case (default 60)")
    ap.add_argument("--warmup", type=int, default=6, help="steps of each case before the rounds (default 6)")
    ap.add_argument("--without-plans", action="store_true",
                    help="also the last attention with the route's launch plans off")
    ap.add_argument("--without-graphs", action="store_true",
                    help="also the last attention with the plans' CUDA graphs off (each plan's kernels launched one by one)")
    ap.add_argument("--without-route", action="store_true",
                    help="also the last attention with the Gluon route off (its model compiled so)")
    ap.add_argument("--forward-min-keys", type=int, metavar="N",
                    help="also the last attention with the Gluon forward at head_dim 64 causal from N keys "
                         "(route.FORWARD_MIN_KEYS; its model compiled so)")
    ap.add_argument("--host-parts", action="store_true",
                    help="also two models of the last attention with its ops' launches, then their bodies, stood in for "
                         "(their host issue times split the last attention's; not training steps)")
    ap.add_argument("--json", type=Path, help="also write the table and every round's times here")
    args = ap.parse_args(argv)
    specs = args.attention or ["sdpa", "triton"]
    extra_case = (args.without_plans or args.without_graphs or args.without_route or args.host_parts
                  or args.forward_min_keys is not None)
    if len(set(specs)) != len(specs) or (len(specs) < 2 and not extra_case):
        ap.error(f"--attention {' '.join(specs)} is invalid; accepted: two or more different attentions "
                 "(or one with --without-plans, --without-graphs, --without-route, --forward-min-keys or --host-parts)")
    if args.forward_min_keys is not None and args.forward_min_keys < 1:
        ap.error(f"--forward-min-keys {args.forward_min_keys} is invalid; accepted: an integer ≥ 1 (keys)")
    if args.rounds < 4:
        ap.error(f"--rounds {args.rounds} is invalid; accepted: an integer ≥ 4 (the ratios' quartiles)")
    try:
        cfg = TrainBenchConfig(attentions=tuple(specs), batch_size=args.batch_size, compile=not args.no_compile,
                               compile_mode=args.compile_mode, warmup=args.warmup)
    except ValueError as err:                  # a spec, the batch, the warm-up or the mode, named as bench train names them
        ap.error(str(err).replace("batch_size=", "--batch-size ").replace("warmup=", "--warmup ")
                 .replace("compile_mode=", "--compile-mode ").replace("attention spec", "--attention"))
    import torch
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (it times training steps there); none is visible")
    import triton
    walls, issues, phases = run_rounds(build_steps(specs, cfg, args.without_plans, args.without_route,
                                                   args.forward_min_keys, args.without_graphs, args.host_parts),
                                       args.rounds)
    table = paired_summary(walls, issues, phases)
    mode = "eager" if args.no_compile else f"torch.compile ({args.compile_mode})"
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "model": cfg.model, "batch_size": args.batch_size, "mode": mode, "rounds": args.rounds,
           "cases": table, "wall_ms": walls, "issue_ms": issues, "issue_phases_ms": phases,
           "phases": list(PHASES)}
    first = next(iter(table))
    print(f"\n{out['gpu']}, torch {out['torch']}, triton {out['triton']}: {cfg.model}, batch {args.batch_size}, "
          f"{mode}, {args.rounds} rounds; ratio = {first}'s step over the case's in the same round")
    print("| case | median step (ms) | host issue (ms) | ratio median | quartiles | issue: forward / backward / "
          "clip and optimizer (ms) |")
    print("|---|---|---|---|---|---|")
    for case, row in table.items():
        q1, q3 = row["paired_ratio_quartiles"]
        split = " / ".join(f"{v:.2f}" for v in row["issue_phase_medians_ms"].values())
        if any(case.endswith(name) for name in STAND_INS.values()):   # host issue only: not a training step
            print(f"| {case} | ({row['median_ms']:.2f}) | {row['issue_median_ms']:.2f} | not a step | | {split} |")
            continue
        print(f"| {case} | {row['median_ms']:.2f} | {row['issue_median_ms']:.2f} | {row['paired_ratio_median']:.3f} "
              f"| {q1:.3f}–{q3:.3f} | {split} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
