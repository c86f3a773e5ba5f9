"""The `stableflash` command: help for every subcommand, the probe end to end, clear errors."""
import json
import time

import pytest

from stableflash.cli import build_parser, main

SUBCOMMANDS = ["explain-add", "probe", "bench", "train", "data", "report", "repro"]


def test_top_level_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_subcommand_help(capsys, name):
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    assert len(capsys.readouterr().out) > 200


def test_probe_json_and_table(capsys, tmp_path):
    args = ["probe", "--batch", "1", "--heads", "2", "--seq-len", "128", "--seed", "5", "-q"]
    assert main(args + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["rows"]) == 24 and result["config"]["seq_len"] == 128
    out_file = tmp_path / "probe.json"
    assert main(args + ["--out", str(out_file)]) == 0
    table = capsys.readouterr().out
    assert "standard" in table and "tied-split" in table and "control" in table
    assert json.loads(out_file.read_text())["rows"] == result["rows"]     # seeded: same numbers


def test_probe_bad_argument_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["probe", "--ties", "1"])
    assert exc.value.code == 2
    assert "ties=1" in capsys.readouterr().err


def test_parser_lists_every_command():
    actions = [a for a in build_parser()._actions if a.dest == "command"]
    assert sorted(actions[0].choices) == sorted(SUBCOMMANDS)


def test_probe_ablation_adds_the_policy_variants(capsys):
    assert main(["probe", "--batch", "1", "--heads", "2", "--seq-len", "128", "-q", "--json", "--ablate"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    variants = {r["policy"] for r in rows}
    assert {"paper, row_sum fp32", "paper, acc fp32", "paper, acc+row_sum fp32"} <= variants
    assert len(rows) == 24 + 5 * 4


def test_bench_attention_help_and_clear_error_without_gpu(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "attention", "--help"])
    assert exc.value.code == 0
    assert "sdpa-cudnn" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["bench", "attention", "--shape", "1,2,3"])
    assert exc.value.code == 2
    assert "B,H,N,d" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU message")
def test_bench_attention_without_gpu_says_so(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "attention"])
    assert exc.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU message")
def test_bench_train_without_gpu_says_so(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "train", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_data_prepare_text_and_errors(tmp_path, capsys):
    src = tmp_path / "txt"
    src.mkdir()
    for i in range(4):
        (src / f"doc{i}.txt").write_text(f"document {i}: " + "héllo wörld " * 50)
    assert main(["data", "prepare", str(src), "--out", str(tmp_path / "tok"), "--tokenizer", "bytes",
                 "--val-fraction", "0.25"]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["vocab_size"] == 256 and meta["tokens"]["train"] > 0 and meta["tokens"]["val"] > 0
    assert (tmp_path / "tok" / "train.bin").stat().st_size == 2 * meta["tokens"]["train"]
    with pytest.raises(SystemExit) as exc:
        main(["data", "prepare", "--out", str(tmp_path / "none")])
    assert exc.value.code == 2 and "nothing to prepare" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--embedded", "notes.txt"], "INPUT files or folders and --embedded name two corpora; accepted: one of them"),
    (["--embedded", "--hf-dataset", "x"], "--hf-dataset and --embedded name two corpora"),
    (["--embedded", "--tokenizer", "gpt2"],
     "--tokenizer gpt2 does not apply to --embedded; accepted with INPUT files or folders or --hf-dataset only"),
    (["--packages", "--pattern", "*.md"], "--pattern *.md does not apply to --packages; accepted with INPUT files"),
    (["notes.txt", "--hf-split", "test"], "--hf-split test does not apply to INPUT files or folders"),
    (["notes.txt", "--text-field", "body"], "--text-field body does not apply to INPUT files or folders"),
    (["--embedded", "--vocab-size", "100"], "--vocab-size 100 does not apply to --embedded; accepted with --packages"),
    (["--embedded", "--val-fraction", "2"], "val_fraction=2.0 is invalid; accepted: a number in (0, 1)"),
])
def test_data_prepare_refuses_options_it_would_ignore(tmp_path, monkeypatch, capsys, argv, message):
    """An option that does not apply to the named corpus, or two corpora at once, is refused with what is
    accepted, before anything is written; none is silently dropped."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("some text " * 20)
    with pytest.raises(SystemExit) as exc:
        main(["data", "prepare", "--out", str(tmp_path / "tok"), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "tok").exists()


def test_data_prepare_embedded_takes_the_val_fraction(monkeypatch, tmp_path, capsys):
    """--val-fraction reaches the embedded corpus's preparation (it was dropped there once); without it the
    preparation's own default stands."""
    from stableflash.train import corpus
    seen = []
    monkeypatch.setattr(corpus, "prepare_embedded", lambda out, **kw: seen.append(kw) or {"ok": True})
    assert main(["data", "prepare", "--embedded", "--val-fraction", "0.05", "--out", str(tmp_path / "a")]) == 0
    assert main(["data", "prepare", "--embedded", "--out", str(tmp_path / "b")]) == 0
    assert seen == [{"overwrite": False, "val_fraction": 0.05}, {"overwrite": False}]


def test_the_benchmarked_training_step_trains(recwarn):
    """The step `bench train` times (and benchmarks/tools/train_profile.py profiles): the same seed builds
    the same model, and the step lowers the loss on its fixed batch (CPU, tiny model, no compile)."""
    import torch

    from stableflash.bench.training import TrainBenchConfig, training_step
    cfg = TrainBenchConfig(model="tiny", attentions=("sdpa",), batch_size=2, compile=False)
    losses = []
    for _ in range(2):
        step, _ = training_step("sdpa", cfg, torch.device("cpu"))
        losses.append([step().item() for _ in range(4)])
    assert losses[0] == losses[1]                                   # same seed, same run
    assert all(b < a for a, b in zip(losses[0], losses[0][1:])), losses[0]
    # with marks: when the host had issued the forward and the backward, in order, and the step the same
    step, _ = training_step("sdpa", cfg, torch.device("cpu"))
    marks = []
    before = time.perf_counter()
    assert step(marks).item() == losses[0][0]
    assert len(marks) == 2 and before <= marks[0] <= marks[1] <= time.perf_counter()


def test_a_compile_mode_the_benchmark_cannot_take_is_refused_by_name():
    from stableflash.bench.training import TrainBenchConfig
    with pytest.raises(ValueError, match=r"compile_mode='graphs' is invalid; accepted: default, reduce-overhead"):
        TrainBenchConfig(compile_mode="graphs")
    assert TrainBenchConfig(compile_mode="reduce-overhead").compile_mode == "reduce-overhead"
    with pytest.raises(SystemExit):
        main(["bench", "train", "--compile-mode", "graphs"])


def test_the_training_bench_table_shows_peak_memory():
    from dataclasses import asdict

    from stableflash.bench.training import TrainBenchConfig, format_table
    result = {"config": asdict(TrainBenchConfig()), "env": {"gpu": "GPU", "torch": "t", "triton": "tr"},
              "rows": [{"attention": "sdpa", "ms_per_step": 34.1, "tokens_per_s": 480340.0, "mfu": 0.415,
                        "peak_mib": 20480.4},
                       {"attention": "triton stabilize=tie-shift+consistent-delta", "ms_per_step": 35.0, "tokens_per_s": 468729.0,
                        "mfu": 0.405, "ratio_to_first": 0.976, "peak_mib": 21000.0}]}
    lines = format_table(result).splitlines()
    assert lines[1].split()[-2:] == ["peak", "MiB"]
    assert lines[2].split()[-1] == "20480" and lines[3].split()[-2:] == ["0.98×", "21000"]


def train_error(argv, capsys) -> str:
    """The one-line error of a `stableflash train` that must fail with exit code 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["train", "-q", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    return err


def test_train_names_an_out_or_config_path_it_cannot_use(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    binary = tmp_path / "config.json"
    binary.write_bytes(bytes(range(256)))
    new = tmp_path / "new"
    for argv, want in (
            (["--out", str(afile)], f"run folder {afile} is a file, not a folder; accepted: a folder"),
            (["--out", str(afile / "run")], f"run folder {afile / 'run'} is inside {afile}, which is a file"),
            (["--out", str(new), "--config", str(tmp_path)], f"config file {tmp_path} is a folder; accepted: a TOML"),
            (["--out", str(new), "--config", str(binary)], f"config file {binary} is not UTF-8 text (byte 128")):
        assert want in train_error(argv, capsys)
    assert afile.read_text() == "not a folder" and not new.exists()


def test_a_train_that_cannot_start_leaves_no_run_folder(tmp_path, capsys, data_dir):
    for n, (extra, want) in enumerate((
            (["--set", "lr=nan"], "lr=nan is invalid; accepted: a finite number with 0 < lr <= 1e+06"),
            (["--set", "grad_clip=nan"], "grad_clip=nan is invalid; accepted: a non-negative finite number"),
            (["--set", "weight_decay=inf"], "weight_decay=inf is invalid; accepted: a non-negative finite number"),
            (["--set", f"data={tmp_path / 'missing'}"], "no folder"),
            (["--set", f"data={data_dir}", "--set", "vocab_size=100"], "vocab_size=100 is smaller than"))):
        out = tmp_path / "runs" / f"r{n}"
        assert want in train_error(["--out", str(out), *extra], capsys)
        assert not (tmp_path / "runs").exists()


# what `python -m stableflash.cli ARGS` runs, then the threads the rank has left: torchrun starts it as a script
RANK_SCRIPT = """
import json, os, sys, threading
from stableflash.cli import main
code = main(sys.argv[1:])
tasks = "/proc/self/task"
native = sorted(open(f"{tasks}/{t}/comm").read().strip() for t in os.listdir(tasks)) if os.path.isdir(tasks) else []
with open(os.environ["THREADS_OUT"] + os.environ["RANK"], "w") as f:
    json.dump({"python": sorted(t.name for t in threading.enumerate()), "native": native}, f)
sys.exit(code)
"""


def test_the_documented_torchrun_command_trains_on_two_cpu_ranks(data_dir, tmp_path):
    """`torchrun --nproc_per_node 2 -m stableflash.cli train --preset tiny` as the docs write it: the
    preset leaves grad_accum unset, so each rank takes one micro-batch, and the run names its
    process-group backend. Both ranks exit 0 (torchrun reports any rank's abort), and neither
    leaves a gloo worker or tqdm's monitor running into the interpreter's shutdown, where a thread
    that touches Python ends the process with "terminate called without an active exception"."""
    import os
    import subprocess
    import sys
    out = tmp_path / "ddp"
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONFAULTHANDLER="1", CUDA_VISIBLE_DEVICES="",
               THREADS_OUT=str(tmp_path / "threads"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           "train", "--preset", "tiny", "--out", str(out), "-q", "--set", f"data={data_dir}",
           "--set", "max_iters=3", "--set", "eval_every=3", "--set", "device=cpu"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "terminate called" not in res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["world_size"], summary["dist_backend"], summary["grad_accum"]) == \
        ("finished", 2, "gloo", 2)
    assert json.loads((out / "config.json").read_text())["grad_accum"] == 2       # what --resume will use
    # rank 0 prints the line for the run, once
    assert res.stdout.count("finished") == 1 and res.stdout.count(
        "finished: 3 steps on 2 ranks (process-group backend gloo, grad_accum 2), final loss ") == 1, res.stdout
    for rank in (0, 1):
        threads = json.loads((tmp_path / f"threads{rank}").read_text())
        assert threads["python"] == ["MainThread"], threads
        assert not [name for name in threads["native"] if "gloo" in name], threads
    # The same run again into that folder, its two ranks started without torchrun's agent (which stops
    # the other ranks as soon as one fails, so under it only rank 0's refusal is sure to be printed):
    # rank 0 decides and each rank refuses with exit 2 instead of waiting for rank 0.
    from tests.conftest import launch_ranks
    for err in launch_ranks(cmd[cmd.index("train"):], timeout=120, expect=2):
        assert "already holds a run; resume it" in err.splitlines()[-1], err[-3000:]
