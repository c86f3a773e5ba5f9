"""Attention speed: stableflash's Triton kernels (stabilized and not) against torch's peers, same run.

Correctness first: every provider is compared with float64 on fresh random inputs at a small
size before anything is timed. Times are medians of ``triton.testing.do_bench`` ("events": each
call launched from Python, so the host's launch time shows wherever it exceeds the GPU's) or of
``triton.testing.do_bench_cudagraph`` ("graph": the calls replayed from a CUDA graph, as a
training step under ``torch.compile(mode="reduce-overhead")`` runs them: the GPU's time alone, L2
not flushed between calls). FLOPs are 4·B·H·N²·d (×½ when causal) for the forward and 3.5× that
for forward+backward.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import platform
from dataclasses import asdict, dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from stableflash.attention import flash_attention, reference
from stableflash.attention.gluon.route import triton_only
from stableflash.attention.policy import resolve_policy

DEFAULT_SHAPES = ((32, 12, 1024, 64), (8, 16, 4096, 64), (4, 16, 8192, 128))
# the shapes the Hopper route is measured at against cuDNN (docs/kernels.md, "Hopper path"): the defaults and
# one more shape each of head_dim 128 and 64
ROUTE_SHAPES = DEFAULT_SHAPES + ((8, 16, 2048, 128), (16, 16, 2048, 64))


class Variant(NamedTuple):
    """One of stableflash's benchmarked kernel variants: the stabilization (a name of
    ``attention.stabilization.NAMES``), the policy preset its policy starts from (None: the dtype's
    default), the policy fields it changes ("{low}" is the input dtype's name), and other
    ``flash_attention`` arguments; ``hopper``: whether the call may take the Gluon Hopper kernels
    where they apply (``attention.gluon.route``; off: the portable Triton kernels alone). Named
    ``stableflash[-STABILIZATION][-VARIANT]``, the stabilization left out where it is the default."""
    stabilize: str
    preset: str | None = None
    changes: dict = {}
    extra: dict = {}
    hopper: bool = True


_E8M5 = {"acc": "e8m5", "row_sum": "e8m5", "out": "e8m5"}
_FP8 = {"p_bar": "fp8_e4m3", "out": "fp8_e4m3"}
_FP8_PV = {"p_bar": "fp8_e4m3", "v_bar": "fp8_e4m3"}
VARIANTS = {
    # what the product runs (flash_attention's default, "consistent-delta"): the standard row max and
    # δ from a source consistent with the backward's P (bf16/fp16 inputs: O plus its rounding residual)
    "stableflash": Variant("consistent-delta"),
    # the same on the portable Triton kernels alone, where the default would take the Hopper kernels
    "stableflash-portable": Variant("consistent-delta", hopper=False),
    "stableflash-none": Variant("none"),
    "stableflash-tie-shift": Variant("tie-shift"),
    "stableflash-tie-shift+consistent-delta": Variant("tie-shift+consistent-delta"),
    "stableflash-all-shift": Variant("all-shift"),
    "stableflash-paper": Variant("paper"),
    # the mitigations of docs/mitigations.md with the tie-shift rule: δ from dP·P or from an fp32
    # recompute of O (one more pass over the keys); O stored with stochastic rounding; O kept in fp32
    # by the forward for δ (one fp32 store); δ from O as computed (an fp32 copy beside the stored O);
    # δ from the stored O plus its rounding residual (2 bytes per element, not 4)
    "stableflash-tie-shift-dpp": Variant("tie-shift", "fa2", {"delta": "dP·P"}),
    "stableflash-tie-shift-recompute": Variant("tie-shift", "fa2", {"delta": "recompute_fp32"}),
    "stableflash-tie-shift-sr-out": Variant("tie-shift", "fa2", {"out": "{low}:stochastic"}),
    "stableflash-tie-shift-o32": Variant("tie-shift", "fa2", {"out": "fp32"}),
    "stableflash-tie-shift-o32c": Variant("tie-shift", "fa2", {"delta": "dO·O32"}),
    "stableflash-tie-shift-o32r": Variant("tie-shift", "fa2", {"delta": "dO·(O+R)"}),
    # δ from O as computed, kept in fp32, with the standard row max (the default keeps it as the stored
    # O plus a residual in the input dtype instead)
    "stableflash-none-o32c": Variant("none", "fa2", {"delta": "dO·O32"}),
    # the accelerated reproduction's arithmetic (ℓ, Ō, O in e8m5 under the "paper" emulation), with
    # those three rounded to nearest-even and stochastically, and with O in fp32
    "stableflash-none-e8m5": Variant("none", "paper", _E8M5),
    "stableflash-none-e8m5-sr": Variant("none", "paper", {k: f"{v}:stochastic" for k, v in _E8M5.items()}),
    "stableflash-none-e8m5-o32": Variant("none", "paper", {**_E8M5, "out": "fp32"}),
    # the FP8 regime's arithmetic (P̄ and O rounded to e4m3, fa2): with the tie-shift rule, alone and
    # with δ from O as computed or from a bf16 P̄V computed beside the fp8 one (one more product)
    "stableflash-tie-shift-fp8": Variant("tie-shift", "fa2", _FP8),
    "stableflash-tie-shift-fp8-o32c": Variant("tie-shift", "fa2", {**_FP8, "delta": "dO·O32"}),
    "stableflash-tie-shift-fp8-o16": Variant("tie-shift", "fa2", {**_FP8, "delta": "dO·O16"}),
    # the same unstabilized, with the O store rounded stochastically, with the 16-bit product's O kept
    # in fp32 for δ, and stabilized by default (that O kept as the residual of the e4m3 store)
    "stableflash-none-fp8": Variant("none", "fa2", _FP8),
    "stableflash-none-fp8-sr": Variant("none", "fa2", {"p_bar": "fp8_e4m3", "out": "fp8_e4m3:stochastic"}),
    "stableflash-none-fp8-o16": Variant("none", "fa2", {**_FP8, "delta": "dO·O16"}),
    "stableflash-fp8": Variant("consistent-delta", "fa2", _FP8),
    # FP8 attention's product: P̄ and V in e4m3 on the fp8 tensor cores (O in bf16), with the
    # tie-shift rule, unstabilized, and stabilized by default
    "stableflash-tie-shift-fp8-pv": Variant("tie-shift", "fa2", _FP8_PV),
    "stableflash-none-fp8-pv": Variant("none", "fa2", _FP8_PV),
    "stableflash-fp8-pv": Variant("consistent-delta", "fa2", _FP8_PV),
    "stableflash-tie-shift-softcap": Variant("tie-shift", extra={"softcap": 30.0}),
}
# the earlier provider names, which the commands recorded beside stored result files use, with the
# variant each named when the providers were renamed ("ours-fp8-o16r-norule" and "ours-o32r-norule"
# spelled the default's δ out). What "ours-stable" ran changed before that (the tie-shift rule alone,
# then with the consistent δ: docs/kernels.md), so a result file keeps the
# names it recorded.
LEGACY_PROVIDERS = {
    "ours-stable": "stableflash", "ours-standard": "stableflash-none", "ours-rule": "stableflash-tie-shift",
    "ours-rule-guard": "stableflash-tie-shift+consistent-delta", "ours-bounded": "stableflash-all-shift",
    "ours-paper-rule": "stableflash-paper", "ours-dpp": "stableflash-tie-shift-dpp",
    "ours-recompute": "stableflash-tie-shift-recompute", "ours-sr-out": "stableflash-tie-shift-sr-out",
    "ours-o32": "stableflash-tie-shift-o32", "ours-o32c": "stableflash-tie-shift-o32c",
    "ours-o32r": "stableflash-tie-shift-o32r", "ours-o32c-norule": "stableflash-none-o32c",
    "ours-e8m5": "stableflash-none-e8m5", "ours-e8m5-sr": "stableflash-none-e8m5-sr",
    "ours-e8m5-o32": "stableflash-none-e8m5-o32", "ours-fp8": "stableflash-tie-shift-fp8",
    "ours-fp8-o32c": "stableflash-tie-shift-fp8-o32c", "ours-fp8-o16": "stableflash-tie-shift-fp8-o16",
    "ours-fp8-norule": "stableflash-none-fp8", "ours-fp8-sr-norule": "stableflash-none-fp8-sr",
    "ours-fp8-o16-norule": "stableflash-none-fp8-o16", "ours-fp8-o16r-norule": "stableflash-fp8",
    "ours-o32r-norule": "stableflash", "ours-fp8-pv": "stableflash-tie-shift-fp8-pv",
    "ours-fp8-pv-norule": "stableflash-none-fp8-pv", "ours-fp8-pv-guard": "stableflash-fp8-pv",
    "ours-softcap": "stableflash-tie-shift-softcap",
}
# "sdpa-default": F.scaled_dot_product_attention with the backend torch picks itself (cuDNN on
# Hopper with recent torch), what a user's model runs; the others force one backend each
PROVIDERS = (*VARIANTS, "sdpa-default", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")
PEERS = ("sdpa-default", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")
TIMINGS = ("events", "graph")
# the inputs' memory: "bhnd" contiguous (B, H, N, d) tensors; "bnhd" q, k, v seen as (B, H, N, d) in one
# (B, N, 3, H, d) buffer, and dO (B, N, H, d) — what a model's fused QKV projection hands attention
LAYOUTS = ("bhnd", "bnhd")


@dataclass
class BenchConfig:
    shapes: tuple[tuple[int, int, int, int], ...] = DEFAULT_SHAPES
    providers: tuple[str, ...] = PROVIDERS
    causal: bool = True
    dtype: str = "bf16"
    modes: tuple[str, ...] = ("fwd", "fwd+bwd")
    warmup_ms: int = 25
    rep_ms: int = 100
    seed: int = 0
    timing: str = "events"
    layout: str = "bhnd"

    def __post_init__(self) -> None:
        self.providers = tuple(provider_name(p) for p in self.providers)
        if self.dtype not in ("bf16", "fp16"):
            raise ValueError(f"dtype={self.dtype!r} is invalid; accepted: bf16, fp16")
        for s in self.shapes:
            if len(s) != 4 or min(s) < 1:
                raise ValueError(f"shape {s} is invalid; accepted: four positive ints B,H,N,d")
        bad_modes = [m for m in self.modes if m not in ("fwd", "fwd+bwd")]
        if bad_modes:
            raise ValueError(f"modes={bad_modes} invalid; accepted: fwd, fwd+bwd")
        if self.timing not in TIMINGS:
            raise ValueError(f"timing={self.timing!r} is invalid; accepted: {', '.join(TIMINGS)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is invalid; accepted: {', '.join(LAYOUTS)}")


def provider_name(name: str) -> str:
    """A provider's current name (an earlier one from ``LEGACY_PROVIDERS`` mapped to it); ValueError
    naming the value and the accepted names for anything else."""
    name = LEGACY_PROVIDERS.get(name, name)
    if name not in PROVIDERS:
        raise ValueError(f"provider {name!r} is unknown; accepted: {', '.join(PROVIDERS)}")
    return name


def _sdpa(backend) -> Callable:
    """SDPA on ``backend``, or with None on the backend torch picks (no ``sdpa_kernel`` around it)."""
    from torch.nn.attention import sdpa_kernel

    def fn(q, k, v, causal):
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


def _flex(shape, causal, device) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    mask = None
    if causal:
        mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, shape[2], shape[2], device=device)

    def fn(q, k, v, causal):
        return compiled(q, k, v, block_mask=mask)
    return fn


def provider_context(name: str):
    """The context a provider's forward and backward both run in: the Triton kernels alone
    (``triton_only``) for a variant that may not take the Gluon Hopper kernels, else nothing."""
    return triton_only() if name in VARIANTS and not VARIANTS[name].hopper else contextlib.nullcontext()


def provider_fn(name: str, shape, causal: bool, device) -> Callable:
    from torch.nn.attention import SDPBackend

    if name in VARIANTS:
        variant = VARIANTS[name]

        def stableflash(q, k, v, causal):
            policy = None
            if variant.preset is not None:
                low = "fp16" if q.dtype == torch.float16 else "bf16"
                policy = resolve_policy(variant.preset, q.dtype).replace(
                    **{f: val.format(low=low) for f, val in variant.changes.items()})
            return flash_attention(q, k, v, causal=causal, stabilize=variant.stabilize, backend="triton",
                                   policy=policy, **variant.extra)
        return stableflash
    if name == "flex":
        return _flex(shape, causal, device)
    return _sdpa({"sdpa-default": None, "sdpa-flash": SDPBackend.FLASH_ATTENTION,
                  "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[name])


def flops(shape, causal: bool, mode: str) -> float:
    b, h, n, d = shape
    f = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
    return f * (3.5 if mode == "fwd+bwd" else 1.0)


def saved_for_backward(fn: Callable, *inputs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``fn(*inputs)`` and the bytes of the tensors autograd keeps for its backward: unique storages,
    those of the inputs and of the output left out (the caller holds them anyway)."""
    skip = {t.untyped_storage().data_ptr() for t in inputs}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    kept.pop(out.untyped_storage().data_ptr(), None)
    return out, sum(kept.values())


def _inputs(shape, dtype, device, gen, layout: str = "bhnd"):
    """Random q, k, v, dO of ``shape`` (B, H, N, d) in memory laid out as ``layout`` (``LAYOUTS``)."""
    if layout == "bnhd":
        B, H, N, d = shape
        qkv = torch.randn(B, N, 3, H, d, generator=gen, device=device).to(dtype)
        do = torch.randn(B, N, H, d, generator=gen, device=device).to(dtype)
        return (*(qkv[:, :, i].transpose(1, 2) for i in range(3)), do.transpose(1, 2))
    q, k, v, do = (torch.randn(*shape, generator=gen, device=device).to(dtype) for _ in range(4))
    return q, k, v, do


TIED_PERIOD = 16      # tied inputs: key j repeats key j mod 16, so every causal row from 31 on (every
                      # row of a non-causal call) holds its largest score at least twice (P̄ = 1 more
                      # than once: the paper's case)


def tied_inputs(shape, dtype, device, gen):
    """Random q, k, v, dO whose keys repeat with period ``TIED_PERIOD`` along the sequence, so that
    the scores of a row are equal in groups, its largest included (in any arithmetic: the same
    products of the same numbers)."""
    q, k, v, do = _inputs(shape, dtype, device, gen)
    idx = torch.arange(shape[2], device=device) % TIED_PERIOD
    return q, k[:, :, idx].contiguous(), v, do


def check(name: str, causal: bool, dtype, device, gen) -> dict:
    """Forward and gradient error against float64 at (2, 4, 512, 64) — before any timing — on random
    inputs ("O", "dQ", "dK", "dV") and on inputs whose rows have tied maxima ("O tied", ...)."""
    shape = (2, 4, 512, 64)
    fn = provider_fn(name, shape, causal, device)
    errs = {}
    for suffix, make in (("", _inputs), (" tied", tied_inputs)):
        q, k, v, do = make(shape, dtype, device, gen)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        with provider_context(name):
            o = fn(*leaves, causal)
            grads = torch.autograd.grad(o, leaves, do)
        want = reference.forward_backward(q, k, v, do, causal=causal)
        for key, got, ref in zip(("O", "dQ", "dK", "dV"), (o, *grads), want):
            errs[key + suffix] = ((got.double() - ref).norm() / ref.norm()).item()
    return errs


def time_one(name: str, shape, mode: str, cfg: BenchConfig, dtype, device, gen) -> float:
    import triton.testing

    q, k, v, do = _inputs(shape, dtype, device, gen, cfg.layout)
    fn = provider_fn(name, shape, cfg.causal, device)
    if mode == "fwd":
        def call():
            with torch.no_grad(), provider_context(name):
                fn(q, k, v, cfg.causal)
    else:
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]     # views keep their strides

        def call():
            with provider_context(name):
                o = fn(*leaves, cfg.causal)
                torch.autograd.grad(o, leaves, do)
    if cfg.timing == "graph":
        return triton.testing.do_bench_cudagraph(call, rep=cfg.rep_ms, return_mode="median")
    return triton.testing.do_bench(call, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median")


def environment() -> dict:
    import triton

    dev = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    return {"gpu": dev.name if dev else None, "sm_count": dev.multi_processor_count if dev else None,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "date": dt.datetime.now(dt.timezone.utc).isoformat()}


def run_bench(cfg: BenchConfig, progress: bool = True, on_row: Callable[[dict], None] | None = None) -> dict:
    """Check, then time every (shape, mode, provider). Returns a JSON-serialisable dict, whose
    "complete" is True; ``on_row`` (if given) gets the partial dict ("complete": False) after every
    timed row, so that a run cut short (a time limit, a lost machine) keeps what it measured."""
    from tqdm.auto import tqdm

    if not torch.cuda.is_available():
        raise ValueError("stableflash bench attention needs a CUDA GPU; none is visible")
    device = torch.device("cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    result = {"config": asdict(cfg), "env": environment(), "complete": False, "checks": {}, "rows": []}
    for name in cfg.providers:
        try:
            result["checks"][name] = check(name, cfg.causal, dtype, device, gen)
        except Exception as exc:                         # a peer missing on this machine: say so
            result["checks"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    jobs = [(s, m, p) for s in cfg.shapes for m in cfg.modes for p in cfg.providers
            if "error" not in result["checks"][p]]
    def timer(shape, mode, name):
        try:
            return time_one(name, shape, mode, cfg, dtype, device, gen)
        finally:
            torch.cuda.empty_cache()

    from stableflash.attention.triton.op import tuned_choices, tuner_timings

    return time_jobs(tqdm(jobs, desc="bench", disable=not progress), timer, result, cfg.causal, on_row,
                     choices=tuned_choices, timings=tuner_timings)


def new_choices(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """The tuners' entries in ``after`` that ``before`` lacks, per kernel (kernels with none left out)."""
    new = {k: {key: c for key, c in v.items() if key not in before.get(k, {})} for k, v in after.items()}
    return {k: v for k, v in new.items() if v}


def time_jobs(jobs, timer: Callable, result: dict, causal: bool, on_row: Callable[[dict], None] | None = None,
              choices: Callable[[], dict] | None = None, timings: Callable | None = None) -> dict:
    """Time each (shape, mode, provider) with ``timer`` (ms) into result["rows"] — a failure
    becomes that row's "error" — handing the partial result to ``on_row`` after each; then the
    ratios, and "complete": True. ``choices`` (the kernels' tuners, ``tuned_choices``): a row that
    made the tuners choose records those choices as "tuned", and ``timings`` (``tuner_timings``)
    what each of those tuners measured for its candidates as "tuner_ms", so that runs which
    disagree can be told apart by the tiles they timed and how close each choice was."""
    for shape, mode, name in jobs:
        row = {"shape": list(shape), "mode": mode, "provider": name}
        before = choices() if choices is not None else {}
        try:
            ms = timer(shape, mode, name)
            row.update(ms=ms, tflops=flops(shape, causal, mode) / ms / 1e9)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        if choices is not None and (tuned := new_choices(before, choices())):
            row["tuned"] = tuned
            if timings is not None:
                row["tuner_ms"] = timings(tuned)
        result["rows"].append(row)
        if on_row is not None:
            on_row(result)
    result["ratios"] = ratios(result["rows"])
    result["complete"] = True
    return result


def ratios(rows: list[dict]) -> list[dict]:
    """Each stableflash variant's TFLOP/s divided by each peer's, per shape and mode."""
    by = {(tuple(r["shape"]), r["mode"], r["provider"]): r.get("tflops") for r in rows}
    out = []
    for (shape, mode, name), t in by.items():
        if name not in VARIANTS or t is None:
            continue
        for peer in PEERS:
            pt = by.get((shape, mode, peer))
            if pt:
                out.append({"shape": list(shape), "mode": mode, "provider": name, "peer": peer, "ratio": t / pt})
    return out


def format_table(result: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    env = result["env"]
    console = Console(width=160, record=True, force_terminal=False)
    with console.capture() as cap:
        t = Table(title=f"correctness vs float64 (‖err‖/‖ref‖, B=2 H=4 N=512 d=64; tied: rows with repeated "
                        f"maxima) — {env['gpu']}")
        keys = ("O", "dQ", "dK", "dV", "O tied", "dQ tied", "dK tied", "dV tied")
        for c in ("provider", *keys):
            t.add_column(c)
        for name, errs in result["checks"].items():
            t.add_row(name, *([f"{errs[k]:.2e}" if k in errs else "-" for k in keys] if "error" not in errs
                              else [errs["error"][:60], *[""] * (len(keys) - 1)]))
        console.print(t)
        providers = list(dict.fromkeys(r["provider"] for r in result["rows"]))
        t = Table(title=f"TFLOP/s (median, {result['config'].get('timing', 'events')} timing), "
                        f"causal={result['config']['causal']}, {result['config']['dtype']}, "
                        f"{result['config'].get('layout', 'bhnd')} inputs — "
                        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}")
        t.add_column("shape")
        t.add_column("mode")
        for p in providers:
            t.add_column(p, justify="right")
        t.add_column("stable / flash", justify="right")
        t.add_column("stable / best peer", justify="right")
        keys = list(dict.fromkeys((tuple(r["shape"]), r["mode"]) for r in result["rows"]))
        by = {(tuple(r["shape"]), r["mode"], r["provider"]): r for r in result["rows"]}
        for shape, mode in keys:
            cells = []
            for p in providers:
                r = by.get((shape, mode, p), {})
                cells.append(f"{r['tflops']:.0f}" if "tflops" in r else "err")
            peers = [by[(shape, mode, p)]["tflops"] for p in PEERS if "tflops" in by.get((shape, mode, p), {})]
            default = by.get((shape, mode, "stableflash"), {}).get("tflops")
            best = f"{default / max(peers):.2f}×" if default and peers else "-"
            flash = by.get((shape, mode, "sdpa-flash"), {}).get("tflops")
            vs_flash = f"{default / flash:.2f}×" if default and flash else "-"
            t.add_row("×".join(map(str, shape)), mode, *cells, vs_flash, best)
        console.print(t)
    return cap.get()
