"""Training speed: GPT-2 steps per second with each attention, same harness, same run.

A step is what ``train`` does per micro-batch (forward under bf16 autocast, backward, clip,
fused AdamW step) on random tokens already on the GPU, so data loading is not timed. Reported:
tokens/s, MFU (against the GPU's dense bf16 peak), and the ratio to the first attention (SDPA).
"""
from __future__ import annotations

import gc
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from stableflash.bench.attention import environment, new_choices
from stableflash.files import write_text_atomic
from stableflash.model import build_model, model_config, parse_attention_spec

log = logging.getLogger(__name__)
# torch's default SDPA, what the product runs (the fused kernels with the default stabilization), the
# same kernels unstabilized and with the tie-shift rule, and the emulations of the two policies
DEFAULT_ATTENTIONS = ("sdpa", "triton", "triton stabilize=none", "triton stabilize=tie-shift",
                      "emulated stabilize=none policy=fa2", "emulated stabilize=none policy=paper")
# torch.compile's modes; "reduce-overhead" replays the step's kernels as CUDA graphs, which removes
# the CPU's launch work (Python launchers included) from the step
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class TrainBenchConfig:
    model: str = "gpt2-small"
    attentions: tuple[str, ...] = DEFAULT_ATTENTIONS
    batch_size: int = 16
    compile: bool = True
    compile_mode: str = "default"
    warmup: int = 5
    steps: int = 20
    seed: int = 0
    peak_tflops: float = 989.0

    def __post_init__(self) -> None:
        for spec in self.attentions:
            parse_attention_spec(spec)
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode={self.compile_mode!r} is invalid; accepted: {', '.join(COMPILE_MODES)}")
        for name in ("batch_size", "warmup", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid; accepted: >= 1")


def training_step(spec: str, cfg: TrainBenchConfig, device: torch.device):
    """(step, model): one training step of ``cfg.model`` with attention ``spec`` (forward under bf16
    autocast, backward, clip, fused AdamW) on fixed random tokens, returning the loss; the model is
    built from ``cfg.seed``. ``step(marks)`` with a list appends ``time.perf_counter()`` when the host has
    issued the forward and when it has issued the backward (the phases of the step's host time). Shared
    with benchmarks/tools/train_profile.py and train_interleaved.py."""
    torch.manual_seed(cfg.seed)
    mcfg = model_config(cfg.model)
    model = build_model(mcfg, attention=spec).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    net = torch.compile(model, mode=cfg.compile_mode) if cfg.compile else model
    graphs = cfg.compile and cfg.compile_mode in ("reduce-overhead", "max-autotune")   # modes that use CUDA graphs
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    x = torch.randint(0, mcfg.vocab_size, (cfg.batch_size, mcfg.block_size), device=device, generator=gen)
    y = torch.randint(0, mcfg.vocab_size, (cfg.batch_size, mcfg.block_size), device=device, generator=gen)

    def step(marks: list | None = None):
        if graphs:                       # a new iteration: the graphs' earlier outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = net(x, y)
        if marks is not None:
            marks.append(time.perf_counter())
        loss.backward()
        if marks is not None:
            marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, model


def time_attention(spec: str, cfg: TrainBenchConfig, device: torch.device) -> dict:
    """Median step time of one attention choice; the model is rebuilt from the same seed."""
    gc.collect()                          # the previous attention's model and graphs go first
    torch.cuda.empty_cache()
    step, model = training_step(spec, cfg, device)
    mcfg = model.config
    # peak over warm-up and timed steps: with CUDA graphs (reduce-overhead) the step's activations
    # are allocated once, while the warm-up captures the graphs, and replays allocate nothing
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(cfg.warmup):
        loss = step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(cfg.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    tokens = cfg.batch_size * mcfg.block_size
    return {"attention": spec, "ms_per_step": ms, "tokens_per_s": tokens / ms * 1e3,
            "mfu": model.flops_per_token() * tokens / (ms / 1e3) / (cfg.peak_tflops * 1e12),
            "loss": loss.item(), "warmup_s": warm_s,
            "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20}


def _tuned_choices():
    """The kernels' ``tuned_choices``, or None without triton: Triton tunes anew in every process, so
    two runs of a step may time different tiles, and each row records the ones its kernels chose."""
    try:
        from stableflash.attention.triton.op import tuned_choices
    except ImportError:
        return None
    return tuned_choices


def run_train_bench(cfg: TrainBenchConfig, progress: bool = True, partial: Path | None = None) -> dict:
    """Time every attention in turn. With ``partial``, the results so far are rewritten there after
    each attention (compiling GPT-2 takes a minute per variant: a run cut short keeps what it measured)."""
    from tqdm.auto import tqdm

    if not torch.cuda.is_available():
        raise ValueError("stableflash bench train needs a CUDA GPU; none is visible")
    device = torch.device("cuda")
    result = {"config": asdict(cfg), "env": environment(), "rows": []}
    rows = result["rows"]
    choices = _tuned_choices()
    for spec in tqdm(cfg.attentions, desc="bench train", disable=not progress):
        before = choices() if choices is not None else {}
        try:
            rows.append(time_attention(spec, cfg, device))
        except Exception as exc:                         # report it, and go on with the others
            rows.append({"attention": spec, "error": f"{type(exc).__name__}: {exc}"[:300]})
        if choices is not None and (tuned := new_choices(before, choices())):
            rows[-1]["tuned"] = tuned                    # the tiles this row's kernels were tuned to
        torch.cuda.empty_cache()
        base = next((r for r in rows if "tokens_per_s" in r), None)
        for r in rows:
            if base and "tokens_per_s" in r:
                r["ratio_to_first"] = r["tokens_per_s"] / base["tokens_per_s"]
        if partial is not None:
            write_text_atomic(partial, json.dumps(result, indent=2))
        log.info("%s", format_table(result))
    return result


def format_table(result: dict) -> str:
    cfg, env = result["config"], result["env"]
    mode = f" ({cfg.get('compile_mode', 'default')})" if cfg["compile"] else ""
    lines = [f"GPT training step, {cfg['model']}, batch {cfg['batch_size']}, compile={cfg['compile']}{mode} — "
             f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}",
             f"{'attention':32s} {'ms/step':>9s} {'tokens/s':>10s} {'MFU':>6s} {'vs first':>9s} {'peak MiB':>9s}"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['attention']:32s} error: {r['error'][:80]}")
        else:
            lines.append(f"{r['attention']:32s} {r['ms_per_step']:9.1f} {r['tokens_per_s']:10.0f} "
                         f"{r['mfu']:6.1%} {r.get('ratio_to_first', 1.0):8.2f}× {r.get('peak_mib', float('nan')):9.0f}")
    return "\n".join(lines)
