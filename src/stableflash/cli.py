"""The `stableflash` command. It parses arguments and calls library functions; nothing more."""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path

from stableflash.files import write_text_atomic


def _cmd_explain_add(args: argparse.Namespace) -> int:
    from stableflash.numerics import explain_add

    trace = explain_add(args.a, args.b, fmt=args.fmt, acc=args.acc)
    if args.json:
        print(json.dumps(trace.to_dict(), indent=2))
    else:
        print(trace)
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    from stableflash.diagnostics.mechanism import ProbeConfig, run_probe, format_table

    cfg = ProbeConfig(
        seq_len=args.seq_len, heads=args.heads, head_dim=args.head_dim, batch=args.batch,
        groups=args.groups, ties=args.ties, block_size=args.block_size, max_logit=args.max_logit,
        beta=args.beta, eps=args.eps, seed=args.seed, low=args.format,
    )
    result = run_probe(cfg, progress=not args.json and not args.quiet, ablate=args.ablate)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
        if args.out is not None:
            print(f"\nJSON written to {args.out}")
    return 0


def _shape(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"shape {text!r} is invalid; accepted: B,H,N,d (four positive ints)")
    return tuple(int(p) for p in parts)


def _stabilization(text: str) -> str:
    """A stabilization name (an earlier spelling is refused with its current name)."""
    from stableflash.attention.stabilization import parse_stabilize
    try:
        return parse_stabilize(text, arg="--stabilize").name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _provider(text: str) -> str:
    from stableflash.bench.attention import provider_name
    try:
        return provider_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cmd_bench_attention(args: argparse.Namespace) -> int:
    from stableflash.bench.attention import BenchConfig, format_table, run_bench

    cfg = BenchConfig(shapes=tuple(args.shape) if args.shape else BenchConfig.shapes,
                      providers=tuple(args.providers) if args.providers else BenchConfig.providers,
                      causal=not args.no_causal, dtype=args.dtype, modes=tuple(args.modes),
                      timing=args.timing, layout=args.layout)
    command = "stableflash " + shlex.join(args.argv)

    def out_path(result: dict) -> Path:
        if args.out.suffix == ".json":
            return args.out
        gpu = (result["env"]["gpu"] or "cpu").replace(" ", "-")
        return args.out / f"attention-{gpu}-{result['env']['date'][:19].replace(':', '')}.json"

    def save_partial(result: dict) -> None:           # what a run cut short has measured so far
        write_text_atomic(out_path(result), json.dumps({**result, "command": command}, indent=2))

    result = run_bench(cfg, progress=not args.json, on_row=save_partial)
    result["command"] = command
    return _report(result, out_path(result), format_table, args.json)


def _report(result: dict, out: Path, format_table, as_json: bool) -> int:
    """Write a benchmark's JSON to ``out`` and print it, or its table."""
    write_text_atomic(out, json.dumps(result, indent=2))
    print(json.dumps(result, indent=2) if as_json else format_table(result))
    if not as_json:
        print(f"JSON written to {out}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from stableflash.train.config import DistInfo, TrainConfig, apply_overrides, load_file, make_config, validate
    from stableflash.train.loop import Interrupted, train

    if args.resume is not None:
        if args.out is not None or args.preset is not None or args.config is not None:
            raise ValueError("--resume DIR continues a run with its own config.json; accepted with it: --set only")
        if not (args.resume / "config.json").is_file():
            what = "does not exist" if not args.resume.exists() else "holds no config.json"
            raise ValueError(f"--resume {args.resume} {what}; accepted: a run folder written by stableflash train "
                             f"(its config.json, metrics.jsonl and checkpoint)")
        saved = load_file(args.resume / "config.json")
        cfg = apply_overrides(apply_overrides(TrainConfig(), saved), args.set or [])
        validate(cfg)
        run_dir = args.resume
    else:
        if args.out is None:
            raise ValueError("--out DIR is required (where metrics.jsonl, ckpt.pt and batches/ go)")
        cfg = make_config(args.preset or "tiny", args.config, args.set)
        run_dir = args.out
    try:
        summary = train(cfg, run_dir, resume=args.resume is not None, progress=not args.quiet,
                        allow_data_change=args.allow_data_change)
    except Interrupted as exc:            # SIGINT / SIGTERM: saved and summarised; one line, 128 + signal
        if args.json:
            print(json.dumps(exc.summary, indent=2, default=str))
        print(f"stableflash train: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:             # before training started, or while its summary was written
        print(f"stableflash train: interrupted; nothing saved beyond what {run_dir} holds", file=sys.stderr)
        return 130
    code = 0 if summary["status"] == "finished" else 3
    if not DistInfo.from_env().is_main:            # under torchrun rank 0 speaks for the run (one JSON document)
        return code
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        loss = summary["final_loss"]
        val = summary["best_val_loss"]
        ranks = (f" on {summary['world_size']} ranks (process-group backend {summary['dist_backend']}, grad_accum "
                 f"{summary['grad_accum']})" if summary.get("world_size", 1) > 1 else "")
        print(f"{summary['status']}: {summary['steps']} steps{ranks}, final loss "
              f"{'-' if loss is None else f'{loss:.4f}'}, best val loss {'-' if val is None else f'{val:.4f}'}; "
              f"metrics in {Path(run_dir) / 'metrics.jsonl'}")
    return code


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    from stableflash.train import corpus

    sources = [name for name, named in (("INPUT files or folders", bool(args.inputs)),
                                        ("--hf-dataset", bool(args.hf_dataset)), ("--embedded", args.embedded),
                                        ("--packages", args.packages)) if named]
    if not sources:
        raise ValueError("nothing to prepare; accepted: INPUT files or folders, --hf-dataset NAME, --embedded or "
                         "--packages")
    if len(sources) > 1:
        raise ValueError(f"{' and '.join(sources)} name {('two', 'three', 'four')[len(sources) - 2]} corpora; "
                         f"accepted: one of them")
    source = sources[0]
    # options given for another source than the one named: refused, not ignored
    applies = {"--tokenizer": (args.tokenizer, ("INPUT files or folders", "--hf-dataset")),
               "--pattern": (args.pattern, ("INPUT files or folders",)),
               "--hf-split": (args.hf_split, ("--hf-dataset",)), "--text-field": (args.text_field, ("--hf-dataset",)),
               "--vocab-size": (args.vocab_size, ("--packages",))}
    for option, (value, sources_of) in applies.items():
        if value is not None and source not in sources_of:
            raise ValueError(f"{option} {value} does not apply to {source}; accepted with "
                             f"{' or '.join(sources_of)} only")
    # the options given, by the preparations' argument names: those not given keep each preparation's own
    # defaults (the share of documents for val.bin among them); the check above leaves only the named source's
    given = {name: value for name, value in (("tokenizer", args.tokenizer), ("pattern", args.pattern),
                                             ("split", args.hf_split), ("text_field", args.text_field),
                                             ("vocab_size", args.vocab_size), ("val_fraction", args.val_fraction))
             if value is not None}
    if args.embedded:
        meta = corpus.prepare_embedded(args.out, overwrite=args.overwrite, **given)
    elif args.packages:
        from stableflash.train.packages_corpus import prepare_packages
        meta = prepare_packages(args.out, overwrite=args.overwrite, **given)
    elif args.hf_dataset:
        meta = corpus.prepare_hf(args.hf_dataset, args.out, overwrite=args.overwrite, **given)
    else:
        meta = corpus.prepare_text(args.inputs, args.out, overwrite=args.overwrite, **given)
    print(json.dumps(meta, indent=2, default=str))
    return 0


def _cmd_bench_train(args: argparse.Namespace) -> int:
    from stableflash.bench.training import DEFAULT_ATTENTIONS, TrainBenchConfig, format_table, run_train_bench

    cfg = TrainBenchConfig(model=args.model, attentions=tuple(args.attention or DEFAULT_ATTENTIONS),
                           batch_size=args.batch_size, compile=not args.no_compile, steps=args.steps,
                           compile_mode=args.compile_mode)
    out = args.out
    if out.suffix != ".json":
        out = out / "training-latest.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = run_train_bench(cfg, progress=not args.json, partial=out)
    result["command"] = "stableflash " + shlex.join(args.argv)
    return _report(result, out, format_table, args.json)


def _cmd_report(args: argparse.Namespace) -> int:
    from stableflash.report import build_report

    html = build_report(args.runs, args.out)
    print(f"report: {html}\nsummary: {html.with_suffix('.json')}\nfigures: {html.parent / (html.stem + '_files')}")
    return 0


def _cmd_repro(args: argparse.Namespace) -> int:
    from stableflash.repro import REPRO_PRESETS, default_preset, run_repro
    from stableflash.repro.run import format_table as repro_table
    from stableflash.repro.run import plan_repro

    name = args.preset or default_preset()
    if name not in REPRO_PRESETS:
        raise ValueError(f"--preset {name!r} is unknown; accepted: {', '.join(REPRO_PRESETS)}")
    preset = REPRO_PRESETS[name]
    if args.stabilize is not None:
        import dataclasses
        preset = dataclasses.replace(preset, stabilization=args.stabilize)
    if preset.gpu and not torch_cuda():
        cpu = ", ".join(k for k, v in REPRO_PRESETS.items() if not v.gpu)
        raise ValueError(f"preset {name!r} needs a GPU (none is visible here); accepted without one: {cpu}")
    out = args.out or Path("runs") / f"repro-{name}"
    if args.ladder:
        from stableflash.repro.ladder import format_ladder, run_ladder
        result = run_ladder(preset, out, seed=args.seeds[0], steps=args.steps, extra=tuple(args.set or ()),
                            progress=not args.quiet, parallel=args.parallel)
        print(json.dumps(result, indent=2, default=str) if args.json else format_ladder(result))
        return 0
    plan_repro(preset, out, seeds=tuple(args.seeds), steps=args.steps, extra=tuple(args.set or ()),
               parallel=args.parallel, roles=tuple(args.roles))       # bad input refused before the probe
    if not args.no_probe:
        from stableflash.diagnostics.mechanism import ProbeConfig, format_table, run_probe
        probe = run_probe(ProbeConfig(), progress=not args.quiet)
        out.mkdir(parents=True, exist_ok=True)
        (out / "probe.json").write_text(json.dumps(probe, indent=2))
        print(format_table(probe))
    result = run_repro(preset, out, seeds=tuple(args.seeds), steps=args.steps, extra=tuple(args.set or ()),
                       progress=not args.quiet, parallel=args.parallel, roles=tuple(args.roles))
    print(json.dumps(result, indent=2, default=str) if args.json else repro_table(result))
    return 0


def _default_help(cpu, gpu) -> str:
    """What the default presets show, and why they are accelerated: for ``repro --help``."""
    return (f"Without a GPU the default preset is {cpu.name}, which shows the failure and the fix in minutes on 2 CPU "
            f"cores (the baseline explodes, the stabilized run and the fp32 control do not) with {cpu.accelerated}: "
            f"an accelerated stand-in for bf16, which {cpu.faithful} (evidence: docs/reproduction.md). With a GPU it "
            f"is {gpu.name}, with {gpu.accelerated}, also an accelerated, labelled stand-in.")


def torch_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stableflash",
        description="Stable low-precision flash attention, and the instruments that show why "
                    "BF16 flash-attention training fails.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "explain-add",
        help="trace one floating-point addition bit by bit",
        description="Trace A + B computed in the accumulator format (--acc) and stored in the "
                    "storage format (--fmt): operand bits, exponent alignment, significand sum, "
                    "normalisation, guard/round/sticky bits, the rounding decision, the stored "
                    "result and its error against the exact sum. "
                    "Example (the paper's): stableflash explain-add -2.4071154594421387 -2.296875",
    )
    p.add_argument("a", type=float, help="first operand (a decimal number; negative numbers are fine)")
    p.add_argument("b", type=float, help="second operand")
    p.add_argument("--fmt", default="bf16", help="storage format of the result (default: bf16)")
    p.add_argument("--acc", default="fp32", help="format the addition is carried out in (default: fp32)")
    p.add_argument("--json", action="store_true", help="print the trace as JSON")
    p.set_defaults(func=_cmd_explain_add)

    p = sub.add_parser(
        "probe",
        help="measure the biased-rounding mechanism at the kernel level (paper Claims 1-3)",
        description="Build synthetic attention inputs with what the paper found in GPT-2's layer 2 "
                    "(rows with several equal maxima, a mostly negative feature of V, dO sharing the "
                    "sign of the output error) and control inputs without ties, run the emulated "
                    "flash attention under the 'paper' and 'fa2' policies under each row-maximum "
                    "rule (standard, paper, tie-shift, all-shift), and report the fraction of P-bar "
                    "entries equal to 1, the signed error of O-bar and O against float64 (in ulps of "
                    "the output format) and the bias of delta = rowsum(dO * O).",
    )
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default: 512)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default: 8)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (default: 64)")
    p.add_argument("--batch", type=int, default=4, help="sequences (default: 4)")
    p.add_argument("--groups", type=int, default=8,
                   help="groups of rows per head, each with its own tied keys (default: 8)")
    p.add_argument("--ties", type=int, default=2, help="equal maxima per row in the tied inputs (default: 2)")
    p.add_argument("--max-logit", type=float, default=14.0,
                   help="score of the tied maxima; other scores are near 0 (default: 14)")
    p.add_argument("--block-size", type=int, default=64, help="key block size of the tiled kernel (default: 64)")
    p.add_argument("--beta", type=float, default=2.0, help="beta of the stabilized rules (default: 2.0)")
    p.add_argument("--eps", type=float, default=1e-3, help="tie tolerance epsilon (default: 1e-3)")
    p.add_argument("--format", default="bf16", help="low-precision format of the kernel (default: bf16)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--ablate", action="store_true",
                   help="also run the tied inputs under the 'paper' policy with single rounding points "
                        "raised to fp32 (row_sum, acc, both, scores, p_bar)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON results to this file")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_probe)

    from stableflash.train.config import PRESETS as TRAIN_PRESETS
    p = sub.add_parser(
        "train",
        help="train a GPT with the chosen attention (per layer and head)",
        description="Train a GPT-2-style model. Start from a preset (tiny trains on 2 CPU cores in "
                    "under a minute; gpt2-small-paper is the paper's recipe), optionally a TOML/JSON "
                    "config file, then --set key=value overrides (unknown keys and bad values are "
                    "rejected by name). Writes DIR/metrics.jsonl (one JSON object per step), "
                    "DIR/ckpt.pt (atomic), DIR/batches/ (the batch order, for replay) and "
                    "DIR/summary.json. Multi-GPU: torchrun --nproc_per_node N -m stableflash.cli train ...",
    )
    p.add_argument("--preset", choices=sorted(TRAIN_PRESETS), help="starting configuration (default: tiny)")
    p.add_argument("--config", type=Path, help="TOML or JSON file of config keys")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one key (repeatable), e.g. --set max_iters=100 --set attention='sdpa; 2: emulated policy=paper'")
    p.add_argument("--out", type=Path, help="run folder (must not hold a run already)")
    p.add_argument("--resume", type=Path, metavar="DIR", help="continue the run in DIR from its checkpoint")
    p.add_argument("--allow-data-change", action="store_true",
                   help="resume (or replay=RUN) even when the data folder's fingerprint differs from the one "
                        "the run recorded in its data.json (refused by default)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_train)

    data = sub.add_parser("data", help="prepare token files", description="Data preparation.")
    data_sub = data.add_subparsers(dest="data_command", metavar="WHAT")
    data_sub.required = True
    p = data_sub.add_parser(
        "prepare",
        help="text files, a Hugging Face dataset, or the embedded corpus -> train.bin/val.bin",
        description="Tokenize text into nanoGPT-style token files (uint16 train.bin / val.bin) plus "
                    "meta.json. Tokenizer: tiktoken GPT-2 when its vocabulary is available offline, "
                    "else bytes (vocab 256). A folder that already holds token files is refused unless "
                    "--overwrite (runs trained on it refuse to resume on the new data). Temporary files "
                    "left by a killed preparation are removed.",
    )
    p.add_argument("inputs", nargs="*", type=Path, help="text files or folders (searched for --pattern)")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the token files already in --out (refused by default)")
    p.add_argument("--tokenizer", default=None, metavar="NAME",
                   help="INPUTS and --hf-dataset: auto (the default), bytes, gpt2, or the path of a tokenizer.json "
                        "(a tokenizers BPE, e.g. the one --packages writes)")
    p.add_argument("--val-fraction", type=float, default=None,
                   help="share of documents for val.bin (default 0.0005; 0.001 with --packages; with --embedded "
                        "the share of bytes, default 0.01)")
    p.add_argument("--pattern", default=None, help="INPUTS: file pattern inside folders (default: *.txt)")
    p.add_argument("--hf-dataset", help="a Hugging Face dataset name (needs the datasets package and the hub)")
    p.add_argument("--hf-split", default=None, help="--hf-dataset: the split (default: train)")
    p.add_argument("--text-field", default=None, help="--hf-dataset: the text column (default: text)")
    p.add_argument("--embedded", action="store_true",
                   help="the embedded default corpus (this Python's standard-library sources, bytes)")
    p.add_argument("--packages", action="store_true",
                   help="the installed-packages corpus: this Python's site-packages text files, one document "
                        "each, with a BPE trained on them by the tokenizers package (train/packages_corpus.py)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="--packages: BPE entries + 1 (the end-of-text id is the last; default 50257, GPT-2's)")
    p.set_defaults(func=_cmd_data_prepare)

    from stableflash.repro.presets import CPU_DEFAULT, GPU_DEFAULT, REPRO_PRESETS
    p = sub.add_parser(
        "repro",
        help="the reproduction: baseline vs stabilized vs fp32-control training on one batch order, and a report",
        description="Run the kernel-level probe, then for each seed train the preset's baseline attention, the "
                    "same stabilized as flash_attention's default stabilizes it (stabilize=consistent-delta: δ from a "
                    "source consistent with the backward's P, chosen for the preset's rounding), and a control "
                    "with O in fp32, on the same batch order; "
                    "print whether each run exploded (and when the monitor warned), and write an HTML report. "
                    + _default_help(REPRO_PRESETS[CPU_DEFAULT], REPRO_PRESETS[GPU_DEFAULT]) + " Presets: " + ", ".join(
                        f"{k} ({'GPU' if v.gpu else 'CPU'})" for k, v in REPRO_PRESETS.items()),
    )
    p.add_argument("--preset", help=f"reproduction preset (default: {CPU_DEFAULT} without a GPU, {GPU_DEFAULT} "
                                    "with one)")
    p.add_argument("--out", type=Path, help="output folder (default: runs/repro-PRESET)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds (default: 0)")
    p.add_argument("--steps", type=int, help="override the preset's number of steps")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="extra training config override")
    p.add_argument("--no-probe", action="store_true", help="skip the kernel-level probe")
    from stableflash.attention.stabilization import NAMES
    p.add_argument("--stabilize", type=_stabilization, metavar="NAME",
                   help="the stabilized run's stabilization, as flash_attention's argument (default: "
                        f"consistent-delta; accepted: {', '.join(NAMES)})")
    p.add_argument("--roles", nargs="+", choices=("baseline", "stabilized", "control"),
                   default=["baseline", "stabilized", "control"],
                   help="which runs of each seed (default: all three; a search may run the baseline alone)")
    p.add_argument("--parallel", type=int, default=1,
                   help="runs at once, as worker processes sharing the machine (default: 1, one after another); "
                        "with --ladder, the rungs after the baseline")
    p.add_argument("--ladder", action="store_true",
                   help="run the paper's isolation experiments instead (first seed only): tiling off, the failing "
                        "layer alone, δ from dP·P, O in fp32 (backward recompute / forward / chosen heads), Ō only")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_repro)

    p = sub.add_parser(
        "report",
        help="one HTML page comparing training runs (loss, spectral norms, repeated maxima, δ bias, monitor)",
        description="Read RUN_DIR/metrics.jsonl (and probes.jsonl, config.json, summary.json where present) "
                    "of each run and write a self-contained HTML page with embedded figures, the PNGs "
                    "beside it and a JSON summary (explosion step, monitor lead time, ...).",
    )
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    p.add_argument("--out", type=Path, default=None, help="HTML file (default: report.html in the first RUN_DIR)")
    p.set_defaults(func=_cmd_report)

    bench = sub.add_parser("bench", help="benchmarks (GPU)", description="Benchmarks; each writes JSON results.")
    bench_sub = bench.add_subparsers(dest="bench", metavar="WHAT")
    bench_sub.required = True
    p = bench_sub.add_parser(
        "attention",
        help="time stableflash's Triton kernels against SDPA (flash, cuDNN, efficient) and FlexAttention",
        description="Check every provider against float64, then time forward and forward+backward "
                    "(median of triton.testing.do_bench, or of its CUDA-graph form with --timing graph) "
                    "for stableflash's kernels (stabilized, unstabilized, other stabilizations) and torch's peers in the same "
                    "run; print TFLOP/s and ratios; write JSON.",
    )
    p.add_argument("--shape", type=_shape, action="append",
                   help="B,H,N,d (repeatable; default: 32,12,1024,64 8,16,4096,64 4,16,8192,128)")
    from stableflash.bench.attention import LAYOUTS, PROVIDERS, TIMINGS
    p.add_argument("--providers", nargs="+", type=_provider, metavar="PROVIDER",
                   help=f"subset of providers (default: all): {', '.join(PROVIDERS)}")
    p.add_argument("--modes", nargs="+", choices=("fwd", "fwd+bwd"), default=["fwd", "fwd+bwd"])
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--no-causal", action="store_true", help="non-causal attention (default: causal)")
    p.add_argument("--timing", choices=TIMINGS, default="events",
                   help="events: each call launched from Python, host launch time included where it "
                        "exceeds the GPU's; graph: calls replayed from a CUDA graph, the GPU's time "
                        "alone (default: events)")
    p.add_argument("--layout", choices=LAYOUTS, default="bhnd",
                   help="bhnd: contiguous (B, H, N, d) inputs; bnhd: q, k, v as (B, H, N, d) views of one "
                        "(B, N, 3, H, d) buffer and dO of a (B, N, H, d) one, what a model's fused QKV "
                        "projection gives (default: bhnd)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                   help="JSON file, or a folder for a named file (default: benchmarks/results)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=_cmd_bench_attention)

    p = bench_sub.add_parser(
        "train",
        help="GPT-2 training steps per second with each attention (GPU)",
        description="Time a GPT training step (bf16 autocast, fused AdamW, torch.compile) with each "
                    "attention spec in the same run, on random tokens already on the GPU; print "
                    "tokens/s, MFU and the ratio to the first spec; write JSON.",
    )
    from stableflash.bench.training import DEFAULT_ATTENTIONS
    p.add_argument("--model", default="gpt2-small", help="model preset (default: gpt2-small)")
    p.add_argument("--attention", action="append",
                   help=f"attention spec (repeatable; default: {', '.join(DEFAULT_ATTENTIONS)})")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--no-compile", action="store_true")
    from stableflash.bench.training import COMPILE_MODES
    p.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                   help="torch.compile mode (reduce-overhead: CUDA graphs, no CPU launch work per step)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_bench_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        parser.exit(2, f"stableflash {args.command}: error: {exc}\n")
    except BrokenPipeError:                # e.g. `stableflash probe | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
