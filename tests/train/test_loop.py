"""The training loop end to end on CPU: learning, bit-exact resume, replay, non-finite stop, CLI."""
import json

import pytest
import torch

from stableflash.cli import main
from stableflash.train.config import make_config
from stableflash.train.loop import train
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


def test_resume_continues_the_same_loss_sequence_bit_for_bit(data_dir, tmp_path):
    # the schedule must not depend on max_iters (which the resume extends): fix its horizon
    fixed = ("ckpt_every=10", "lr_decay_iters=30")
    straight = train(cfg_for(data_dir, "max_iters=30", *fixed), tmp_path / "a", progress=False)
    train(cfg_for(data_dir, "max_iters=20", *fixed), tmp_path / "b", progress=False)
    resumed = train(cfg_for(data_dir, "max_iters=30", *fixed), tmp_path / "b", resume=True, progress=False)
    assert straight["status"] == resumed["status"] == "finished"
    assert losses(tmp_path / "a") == losses(tmp_path / "b")         # exact equality, 30 steps
    rows = (tmp_path / "b" / "batches" / "rank0.bin").stat().st_size
    assert rows == (tmp_path / "a" / "batches" / "rank0.bin").stat().st_size


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
    state = torch.load(tmp_path / "r" / "ckpt.pt", weights_only=False)
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
                        (["train", "--resume", str(tmp_path / "nothing")], "does not exist")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert match in capsys.readouterr().err


@pytest.mark.slow
def test_ddp_splits_the_global_batch_like_one_process(data_dir, tmp_path):
    """Two gloo ranks on CPU consume the micro-batches one process consumes, and their average loss
    per step matches the one-process run (same global batch) to float32 summation order."""
    import os
    import subprocess
    import sys
    # on the CPU on any machine: two ranks need two GPUs, and a GPU's sums differ from the CPU's
    single = train(cfg_for(data_dir, "max_iters=5", "grad_accum=2", "device=cpu"), tmp_path / "one", progress=False)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONFAULTHANDLER="1",   # a crash shows its stack
               CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "stableflash.cli", "train", "--preset", "tiny", "--out", str(tmp_path / "two"), "-q",
           "--set", f"data={data_dir}", "--set", "max_iters=5", "--set", "grad_accum=2", "--set", "device=cpu"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[:2000] + "\n[...]\n" + res.stderr[-2000:]   # the ranks' own errors come first
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert single["status"] == "finished" and len(two) == 5
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-4, (one, two)


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
    state = torch.load(out / "ckpt.pt", weights_only=False)
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
