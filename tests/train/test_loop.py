"""The training loop end to end on CPU: learning, bit-exact resume, replay, non-finite stop, CLI."""
import io
import json

import pytest
import torch

from stableflash.cli import main
from stableflash.train.config import make_config
from stableflash.train.loop import build_model, train
from stableflash.report.runs import load_run
from stableflash.train.metrics import read_metrics


def cfg_for(data_dir, *extra):
    return make_config("tiny", overrides=[f"data={data_dir}", *extra])


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "event" not in r]


def test_tiny_preset_learns(data_dir, tmp_path):
    summary = train(cfg_for(data_dir), tmp_path / "run", progress=False)
    got = losses(tmp_path / "run")
    assert summary["status"] == "finished" and summary["steps"] == 150 and len(got) == 150
    assert got[0] > 5.0                       # ≈ ln 256 = 5.55 at initialisation
    assert sum(got[-10:]) / 10 < got[0] - 2.0  # the byte-level model learns real structure
    assert summary["best_val_loss"] < 3.5
    assert (tmp_path / "run" / "ckpt.pt").exists() and (tmp_path / "run" / "batches" / "rank0.bin").exists()


def test_resume_continues_the_same_loss_sequence_bit_for_bit(data_dir, tmp_path, caplog):
    # the schedule must not depend on max_iters (which the resume extends): fix its horizon
    fixed = ("ckpt_every=10", "lr_decay_iters=30")
    straight = train(cfg_for(data_dir, "max_iters=30", *fixed), tmp_path / "a", progress=False)
    train(cfg_for(data_dir, "max_iters=20", *fixed), tmp_path / "b", progress=False)
    # what a run killed mid-write leaves: a line cut short in each JSON-lines file, temporary files
    b = tmp_path / "b"
    for name in ("metrics.jsonl", "probes.jsonl"):
        with open(b / name, "a") as f:
            f.write('{"step": 20, "loss": 2.7')
    stale = [b / ".ckpt.pt.tmp-4242", b / ".metrics.jsonl.tmp-4242", b / ".summary.json.tmp-4242"]
    for path in stale:
        path.write_bytes(b"partial")
    with caplog.at_level("WARNING", logger="stableflash.train.metrics"):
        resumed = train(cfg_for(data_dir, "max_iters=30", *fixed), b, resume=True, progress=False)
    assert straight["status"] == resumed["status"] == "finished"
    assert losses(tmp_path / "a") == losses(b)                      # exact equality, 30 steps
    assert straight["best_val_loss"] == resumed["best_val_loss"] and straight["final_loss"] == resumed["final_loss"]
    rows = (b / "batches" / "rank0.bin").stat().st_size
    assert rows == (tmp_path / "a" / "batches" / "rank0.bin").stat().st_size
    assert [r["step"] for r in read_metrics(b / "probes.jsonl")] == [0]          # probe_every=100
    for name in ("metrics.jsonl", "probes.jsonl"):
        assert f"{b / name}: dropped line" in caplog.text
    assert not any(path.exists() for path in stale)


def test_replay_consumes_the_recorded_batches(data_dir, tmp_path):
    train(cfg_for(data_dir, "max_iters=12", "seed=1"), tmp_path / "src", progress=False)
    # a different seed would draw other batches; replay must override it
    train(cfg_for(data_dir, "max_iters=12", "seed=1", f"replay={tmp_path / 'src'}",
                  "attention=emulated policy=fp32"), tmp_path / "dst", progress=False)
    a = (tmp_path / "src" / "batches" / "rank0.bin").read_bytes()
    b = (tmp_path / "dst" / "batches" / "rank0.bin").read_bytes()
    assert a == b
    # same data, same weights: fp32 emulated attention tracks SDPA's losses closely
    la, lb = losses(tmp_path / "src"), losses(tmp_path / "dst")
    assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-3
    with pytest.raises(ValueError, match="never recorded"):
        train(cfg_for(data_dir, "max_iters=20", f"replay={tmp_path / 'src'}"), tmp_path / "long", progress=False)


def test_nonfinite_loss_stops_cleanly_and_keeps_the_checkpoint(data_dir, tmp_path, monkeypatch):
    from stableflash.model import gpt
    real = gpt.GPT.forward
    calls = {"n": 0}

    def poisoned(self, idx, targets=None):
        logits, loss = real(self, idx, targets)
        calls["n"] += 1
        if self.training and calls["n"] > 8:           # from the 9th training forward on
            loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(gpt.GPT, "forward", poisoned)
    summary = train(cfg_for(data_dir, "max_iters=20", "ckpt_every=4", "eval_every=100", "probe_every=0"), tmp_path / "r",
                    progress=False)
    assert summary["status"] == "nonfinite" and summary["steps"] == 8
    events = [r for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if r.get("event") == "nonfinite"]
    assert len(events) == 1 and events[0]["step"] == 8
    state = torch.load(tmp_path / "r" / "ckpt.pt", weights_only=True)
    assert state["step"] == 8 and all(torch.isfinite(v).all() for v in state["model"].values())


def test_cli_train_resume_and_errors(data_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["train", "--preset", "tiny", "--out", str(out), "-q", "--set", f"data={data_dir}",
                 "--set", "max_iters=6", "--set", "ckpt_every=3"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6)) and all("loss" in r for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [5]
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "-q", "--set", "max_iters=9", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 9
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "event" not in r] == list(range(9))
    for argv, match in ((["train", "--out", str(tmp_path / "x"), "--set", "max_iter=3"], "did you mean max_iters"),
                        (["train", "--out", str(out), "--set", f"data={data_dir}"], "already holds a run"),
                        (["train", "--out", str(tmp_path / "y"), "--set", "data=/nonexistent"], "no folder"),
                        (["train", "--resume", str(tmp_path / "nothing")], "--resume " + str(tmp_path / "nothing")
                         + " does not exist; accepted: a run folder written by stableflash train"),
                        (["train", "--resume", str(tmp_path)], f"--resume {tmp_path} holds no config.json; accepted:")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert match in capsys.readouterr().err


def test_resume_with_another_attention_forks_the_run_with_that_arithmetic(data_dir, tmp_path, capsys):
    """A copy of a run folder resumed with --set attention=... continues from the checkpoint with the
    new spec in every layer (a fork: the same weights, optimizer and batch order, other arithmetic);
    the run resumed without it keeps the spec it ran with."""
    import shutil
    out = tmp_path / "base"
    assert main(["train", "--preset", "tiny", "--out", str(out), "-q", "--set", f"data={data_dir}",
                 "--set", "max_iters=4", "--set", "ckpt_every=2", "--set", "attention=sdpa"]) == 0
    fork = tmp_path / "fork"
    shutil.copytree(out, fork)
    capsys.readouterr()
    spec = "emulated stabilize=none policy=fa2"
    assert main(["train", "--resume", str(fork), "-q", "--set", "max_iters=6", "--set", f"attention={spec}",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 6 and summary["final_attention"] == summary["attention"] == spec
    assert json.loads((fork / "config.json").read_text())["attention"] == spec
    assert [r["step"] for r in read_metrics(fork / "metrics.jsonl") if "event" not in r] == list(range(6))
    assert losses(fork)[:4] == losses(out)                     # the records before the fork are the run's
    assert main(["train", "--resume", str(out), "-q", "--set", "max_iters=6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["final_attention"] == "sdpa"


@pytest.mark.slow
def test_ddp_splits_the_global_batch_like_one_process(data_dir, tmp_path):
    """Two gloo ranks on CPU consume the micro-batches one process consumes, and their average loss
    per step matches the one-process run (same global batch) to float32 summation order; rank 0
    probes the step's last global micro-batch, as one process does, so the probe records agree.
    MFU divides the run's FLOP/s by the peak of both GPUs (``peak_tflops`` is one GPU's)."""
    from tests.conftest import launch_ranks
    # on the CPU on any machine: two ranks need two GPUs, and a GPU's sums differ from the CPU's
    single = train(cfg_for(data_dir, "max_iters=5", "grad_accum=2", "device=cpu", "probe_every=2", "peak_tflops=1"),
                   tmp_path / "one", progress=False)
    launch_ranks(["train", "--preset", "tiny", "--out", str(tmp_path / "two"), "-q", "--set", f"data={data_dir}",
                  "--set", "max_iters=5", "--set", "grad_accum=2", "--set", "device=cpu", "--set", "probe_every=2",
                  "--set", "peak_tflops=1"])
    rows = {name: [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if "event" not in r]
            for name in ("one", "two")}
    # FLOPs per token (the same model) over the peak: mfu / tokens_per_s, per row
    per_token = {name: [r["mfu"] / r["tokens_per_s"] for r in rs] for name, rs in rows.items()}
    assert len(per_token["one"]) == len(per_token["two"]) == 5
    for a, b in zip(per_token["one"], per_token["two"]):
        assert b == pytest.approx(a / 2, rel=1e-9)
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert single["status"] == "finished" and len(two) == 5
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-4, (one, two)
    p1, p2 = (load_run(tmp_path / name).probes for name in ("one", "two"))
    assert [p["step"] for p in p1] == [p["step"] for p in p2] == [0, 2, 4]
    for a, b in zip(p1, p2):          # the same batch's logits: equal to the weights' float32 drift
        assert torch.tensor(b["row"]["max_logit"]) == pytest.approx(torch.tensor(a["row"]["max_logit"]), rel=1e-3)


def test_tensorboard_gets_the_same_scalars_as_metrics_jsonl(data_dir, tmp_path):
    """--set tensorboard=true: every per-step number of metrics.jsonl is a TensorBoard scalar."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    train(cfg_for(data_dir, "max_iters=12", "eval_every=6", "tensorboard=true"), tmp_path / "run", progress=False)
    acc = event_accumulator.EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "event" not in r]
    tb_loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert sorted(tb_loss) == [r["step"] for r in rows] and len(rows) == 12
    for r in rows:
        assert tb_loss[r["step"]] == pytest.approx(r["loss"], rel=1e-6)       # stored as float32
    assert {"lr", "grad_norm", "tokens_per_s", "val_loss"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("val_loss")] == [5, 11]


def test_a_run_folder_of_the_earlier_spec_grammar_resumes_with_its_meaning(data_dir, tmp_path, capsys):
    """A run written before ``config_version`` (its config.json and checkpoint lack it), in which a
    bare emulated entry was unstabilized and "delta=auto" the monitor's switch, resumes as what it
    was: the config's specs and the checkpoint's switched spec are upgraded on load."""
    out = tmp_path / "old"
    assert main(["train", "--preset", "tiny", "--out", str(out), "-q", "--set", f"data={data_dir}",
                 "--set", "max_iters=4", "--set", "ckpt_every=2", "--set",
                 "attention=sdpa; 1: emulated stabilize=none policy=fa2"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["config_version"] == 2
    del config["config_version"]                                   # as the earlier version wrote it
    config.update(attention="sdpa; 1: emulated policy=fa2", monitor_switch_to="delta=auto")
    (out / "config.json").write_text(json.dumps(config))
    state = torch.load(out / "ckpt.pt", weights_only=True)
    del state["config"]["config_version"]
    state["attention"] = "sdpa; 1: emulated policy=fa2"
    torch.save(state, out / "ckpt.pt")
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "-q", "--set", "max_iters=6", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["final_attention"] == "sdpa; 1: emulated stabilize=none policy=fa2"
    saved = json.loads((out / "config.json").read_text())
    assert saved["config_version"] == 2 and saved["monitor_switch_to"] == "delta=consistent"
    assert saved["attention"] == "sdpa; 1: emulated stabilize=none policy=fa2"


class RunsCode:
    """Unpickling it runs code (here: creates a marker file), as a hostile ckpt.pt would."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def code_running_checkpoint(marker) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": RunsCode(marker), "step": 1}, buf)
    return buf.getvalue()


def test_a_damaged_or_hostile_checkpoint_is_a_clear_error_naming_it(data_dir, tmp_path, capsys):
    """--resume of a ckpt.pt that would run code when unpickled, or is empty, truncated, random,
    text, another object, or another model's weights under a forged config: exit 2 and one line
    naming the file; the code never runs. The real checkpoint of a finished run then resumes with
    nothing to do and leaves its summary's numbers as they were; a malformed line in the middle of
    metrics.jsonl is an error naming the file and the line."""
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--out", str(out), "-q", "--set", f"data={data_dir}",
                 "--set", "max_iters=3", "--set", "eval_every=2", "--set", "probe_every=0"]) == 0
    finished = json.loads((out / "summary.json").read_text())
    good = (out / "ckpt.pt").read_bytes()
    state = torch.load(out / "ckpt.pt", weights_only=True)
    wider = build_model(cfg_for(data_dir, "n_embd=48", "n_head=2"), 256)
    state["model"] = wider.state_dict()           # the config still says this run's model
    forged, tensor = io.BytesIO(), io.BytesIO()
    torch.save(state, forged)
    torch.save(torch.ones(3), tensor)
    marker = tmp_path / "MARKER"
    cases = {"code": (code_running_checkpoint(marker), "was refused unread: it names the Python object exec"),
             "empty": (b"", "(0 bytes; it is empty)"),
             "truncated": (good[: len(good) // 2], "damaged or truncated"),
             "random": (torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                      dtype=torch.uint8).numpy().tobytes(), "damaged or truncated"),
             "text": (b"step = 3\n", "damaged or truncated"),
             "tensor": (tensor.getvalue(), "holds a Tensor; accepted: a checkpoint written by stableflash train"),
             "shapes": (forged.getvalue(), "does not fit this model: transformer.wte.weight has shape (256, 48) "
                                           "in the checkpoint, (256, 64) in the model")}
    for name, (payload, match) in cases.items():
        (out / "ckpt.pt").write_bytes(payload)
        with pytest.raises(SystemExit) as exc:
            main(["train", "--resume", str(out), "-q"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.startswith(f"stableflash train: error: checkpoint {out / 'ckpt.pt'} "), (name, err)
        assert match in err and len(err.splitlines()) == 1, (name, err)
    assert not marker.exists()
    # the run's own checkpoint: finished at max_iters, nothing to train; the summary keeps its numbers
    (out / "ckpt.pt").write_bytes(good)
    assert main(["train", "--resume", str(out), "-q"]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["steps"] == 3 and again["status"] == "finished"
    assert again["final_loss"] == finished["final_loss"] and again["best_val_loss"] == finished["best_val_loss"]
    assert again["best_val_loss"] is not None and f"best val loss {finished['best_val_loss']:.4f}" in capsys.readouterr().out
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join([lines[0], lines[1][:9], *lines[2:]]) + "\n")
    with pytest.raises(SystemExit) as exc:
        main(["train", "--resume", str(out), "-q"])
    assert exc.value.code == 2 and f"{out / 'metrics.jsonl'} line 2 is not a JSON object" in capsys.readouterr().err


def test_monitor_rollback_refuses_a_checkpoint_that_would_run_code(data_dir, tmp_path, monkeypatch, capsys):
    """The monitor's rollback reads ckpt.pt as --resume does: a hostile file put in place of the
    checkpoint of step 5 is refused when the rollback at step 7 reads it, and its code never runs."""
    from stableflash.train import checkpoint
    from tests.train.test_diagnostics_in_training import TRIGGER
    marker = tmp_path / "MARKER"
    real_save = checkpoint.save

    def save_then_replace(run_dir, state):
        path = real_save(run_dir, state)
        path.write_bytes(code_running_checkpoint(marker))
        return path

    monkeypatch.setattr(checkpoint, "save", save_then_replace)
    out = tmp_path / "r"
    argv = ["train", "--preset", "tiny", "--out", str(out), "-q", "--set", f"data={data_dir}"]
    for kv in ("max_iters=20", "ckpt_every=5", "probe_every=7", "monitor=rollback", *TRIGGER, "monitor_patience=2"):
        argv += ["--set", kv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"checkpoint {out / 'ckpt.pt'} was refused unread" in err
    assert not marker.exists()


def test_best_val_loss_counts_the_evaluations_before_the_resume(data_dir, tmp_path, capsys):
    """Resumed at step 10 with a learning rate that makes the model worse, the best validation loss
    is the one of step 9, before the resume: in summary.json, the CLI line and the report."""
    out = tmp_path / "r"
    assert main(["train", "--preset", "tiny", "--out", str(out), "-q", "--set", f"data={data_dir}",
                 "--set", "max_iters=10", "--set", "eval_every=5", "--set", "ckpt_every=10", "--set", "probe_every=0"]) == 0
    assert main(["train", "--resume", str(out), "-q", "--set", "max_iters=20", "--set", "lr=0.3",
                 "--set", "min_lr=0.3"]) == 0
    vals = {r["step"]: r["val_loss"] for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r}
    assert sorted(vals) == [4, 9, 14, 19] and min(vals[14], vals[19]) > vals[9]      # worse after the resume
    best = min(vals.values())
    assert json.loads((out / "summary.json").read_text())["best_val_loss"] == best == vals[9]
    assert f"best val loss {best:.4f}" in capsys.readouterr().out
    from stableflash.report.html import run_summary
    from stableflash.report.runs import load_run
    assert run_summary(load_run(out))["best_val_loss"] == best


def test_a_run_stopped_before_its_first_checkpoint_is_started_again_not_appended_to(data_dir, tmp_path, capsys):
    """The same --out again is refused (it would log steps 0.. a second time); --resume starts it
    again from step 0, its partial records replaced, and draws what it drew."""
    out = tmp_path / "r"
    argv = ["train", "--preset", "tiny", "--out", str(out), "-q", "--set", f"data={data_dir}",
            "--set", "max_iters=8"]
    assert main(argv) == 0
    first = losses(out)
    (out / "ckpt.pt").unlink()                    # as a run killed before its first checkpoint leaves it
    (out / "summary.json").unlink()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "already holds a run without a checkpoint (metrics.jsonl, probes.jsonl;" in err
    assert f"--resume {out}" in err
    assert main(["train", "--resume", str(out), "-q"]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(8)) and losses(out) == first
    assert [r["step"] for r in read_metrics(out / "probes.jsonl")] == [0]       # probe_every=100


# the CLI with each step slowed down, so that a signal reliably lands in the middle of a run
SLOW_CLI = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)   # as under a terminal (a background job ignores it)
from stableflash.train import loop
lr_at = loop.lr_at
def slow(step, cfg):
    time.sleep(0.1)
    return lr_at(step, cfg)
loop.lr_at = slow
from stableflash.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigint_and_sigterm_save_the_last_step_and_resume_to_the_same_losses(data_dir, tmp_path):
    """Ctrl-C and a scheduler's SIGTERM in the middle of a run: the run saves the checkpoint of its
    last completed step, writes summary.json with status "interrupted", prints one line (no
    traceback) and exits 130 / 143; --resume then gives the uninterrupted run's losses exactly."""
    import os
    import signal
    import subprocess
    import sys
    import time
    fixed = ("max_iters=30", "ckpt_every=10", "eval_every=10", "lr_decay_iters=30", "probe_every=0")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    runs = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        out = tmp_path / sig.name
        cmd = [sys.executable, "-c", SLOW_CLI, "train", "--preset", "tiny", "--out", str(out), "-q",
               "--set", f"data={data_dir}", *(a for kv in fixed for a in ("--set", kv))]
        runs[sig] = (out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    train(cfg_for(data_dir, *fixed), tmp_path / "straight", progress=False)
    for sig, (out, proc) in runs.items():
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(sig)
    for sig, (out, proc) in runs.items():
        _, err = proc.communicate(timeout=120)
        summary = json.loads((out / "summary.json").read_text())
        done = summary["steps"]
        assert proc.returncode == 128 + sig, err
        assert "Traceback" not in err and err.splitlines()[-1] == (
            f"stableflash train: interrupted by {sig.name} after {done} steps: checkpoint of step {done} saved in "
            f"{out / 'ckpt.pt'}; continue with: stableflash train --resume {out}")
        assert summary["status"] == "interrupted" and summary["signal"] == sig.name and 3 <= done < 30
        assert summary["checkpoint_step"] == done and torch.load(out / "ckpt.pt", weights_only=True)["step"] == done
        assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(done))
        assert main(["train", "--resume", str(out), "-q"]) == 0
        assert losses(out) == losses(tmp_path / "straight")


def test_a_second_ctrl_c_during_the_save_stops_at_once_and_keeps_the_last_checkpoint(data_dir, tmp_path, monkeypatch,
                                                                                     capsys, ctrl_c):
    """Ctrl-C in step 7 asks for a save after it; Ctrl-C again while that save writes stops at once:
    the checkpoint of step 5 stays whole, no temporary file is left, the previous signal handlers
    come back, and the run resumes from step 5 to the uninterrupted losses."""
    import os
    import signal
    from stableflash.train import loop
    fixed = ("max_iters=20", "ckpt_every=5", "lr_decay_iters=20", "probe_every=0")
    train(cfg_for(data_dir, *fixed), tmp_path / "straight", progress=False)
    real_lr_at, real_save = loop.lr_at, torch.save

    def lr_at(step, cfg):
        if step == 7:
            os.kill(os.getpid(), signal.SIGINT)
        return real_lr_at(step, cfg)

    def save(obj, f):
        if obj["step"] == 8:
            os.kill(os.getpid(), signal.SIGINT)
        real_save(obj, f)

    monkeypatch.setattr(loop, "lr_at", lr_at)
    monkeypatch.setattr(torch, "save", save)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    out = tmp_path / "r"
    argv = ["train", "--preset", "tiny", "--out", str(out), "-q", "--set", f"data={data_dir}"]
    assert main([*argv, *(a for kv in fixed for a in ("--set", kv))]) == 130
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1] == (
        f"stableflash train: stopped at once by a second SIGINT after 8 steps: nothing saved since the checkpoint of "
        f"step 5 ({out / 'ckpt.pt'}); continue with: stableflash train --resume {out}")
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["checkpoint_step"]) == ("interrupted", 8, 5)
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 5
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    monkeypatch.undo()
    assert main(["train", "--resume", str(out), "-q"]) == 0
    assert losses(out) == losses(tmp_path / "straight")
    # what train() raises comes whole through a worker process's result (repro --parallel)
    import pickle
    from stableflash.train.loop import Interrupted
    back = pickle.loads(pickle.dumps(Interrupted(summary, signal.SIGTERM, "stopped")))
    assert (back.summary, back.exit_code, str(back)) == (summary, 143, "stopped") and isinstance(back, KeyboardInterrupt)
