"""parallel=fsdp: two gloo ranks on CPU train through FSDP2 (fully_shard) the losses one process
trains with the same global batch, write the single-file checkpoint an unsharded run writes, and
resume from it to the same losses; a configuration FSDP cannot run is a clear error."""
import os
import subprocess
import sys

import pytest
import torch

from stableflash.cli import main
from stableflash.train.config import make_config
from stableflash.train.loop import train
from stableflash.train.metrics import read_metrics

FIXED = ("grad_accum=4", "device=cpu", "probe_every=0", "ckpt_every=3", "lr_decay_iters=6", "eval_every=3",
         "eval_iters=2")


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "event" not in r]


def torchrun(data_dir, out, *sets, resume=False):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONFAULTHANDLER="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "stableflash.cli", "train", "-q"]
    cmd += ["--resume", str(out)] if resume else ["--preset", "tiny", "--out", str(out)]
    for s in (f"data={data_dir}", "parallel=fsdp", *FIXED, *sets):
        cmd += ["--set", s]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[:2000] + "\n[...]\n" + res.stderr[-2000:]


@pytest.mark.slow
def test_fsdp_two_ranks_train_resume_and_checkpoint_like_one_process(data_dir, tmp_path):
    one = make_config("tiny", overrides=[f"data={data_dir}", *FIXED, "max_iters=6"])
    single = train(one, tmp_path / "one", progress=False)
    torchrun(data_dir, tmp_path / "two", "max_iters=3")
    # the checkpoint of step 3: the existing single-file format, with the weights and optimizer state
    # an unsharded run holds at step 3 (to float32 summation order)
    train(make_config("tiny", overrides=[f"data={data_dir}", *FIXED, "max_iters=3"]), tmp_path / "ref", progress=False)
    got = torch.load(tmp_path / "two" / "ckpt.pt", weights_only=True)
    ref = torch.load(tmp_path / "ref" / "ckpt.pt", weights_only=True)
    assert got["step"] == 3 and got["model"].keys() == ref["model"].keys()
    for k, v in ref["model"].items():
        assert type(got["model"][k]) is torch.Tensor and torch.allclose(got["model"][k], v, atol=1e-5), k
    g, r = got["optimizer"]["adamw"], ref["optimizer"]["adamw"]
    assert [x["params"] for x in g["param_groups"]] == [x["params"] for x in r["param_groups"]]
    for i, st in r["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(g["state"][i][key], st[key], atol=1e-6, rtol=1e-4), (i, key)
    torchrun(data_dir, tmp_path / "two", "max_iters=6", resume=True)
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert single["status"] == "finished" and len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)
    assert a[0] > a[-1] + 0.3                             # it trains: the comparison is not of constants
    # and the reverse: the one-process checkpoint of step 3 resumes on two FSDP ranks to the same losses
    torchrun(data_dir, tmp_path / "ref", "max_iters=6", resume=True)
    assert max(abs(x - y) for x, y in zip(a, losses(tmp_path / "ref"))) < 1e-4
    # the sharded run's checkpoint resumes in one process (the format is the one unsharded runs use)
    summary = train(make_config("tiny", overrides=[f"data={data_dir}", *FIXED, "max_iters=7"]),
                    tmp_path / "two", resume=True, progress=False)
    assert summary["status"] == "finished" and summary["steps"] == 7


@pytest.mark.parametrize("sets, match", [
    (["parallel=zero"], "parallel='zero' is invalid; accepted: ddp, fsdp"),
    (["parallel=fsdp"], "parallel=fsdp shards the model over the ranks of a torchrun launch"),
])
def test_bad_parallel_is_a_clear_error(data_dir, tmp_path, capsys, sets, match):
    argv = ["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "-q", "--set", f"data={data_dir}"]
    for s in sets:
        argv += ["--set", s]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("sets, match", [
    (["probe_every=100"], "probe_every=100 cannot apply with parallel=fsdp"),
    (["probe_every=0", "monitor=rollback"], "monitor=rollback cannot apply with parallel=fsdp"),
    (["probe_every=0", "dtype=fp16"], "dtype=fp16 cannot apply with parallel=fsdp"),
])
def test_what_fsdp_cannot_run_with_is_named(sets, match):
    from stableflash.train.config import check_parallel
    cfg = make_config("tiny", overrides=["parallel=fsdp", *sets])
    with pytest.raises(ValueError, match=match):
        check_parallel(cfg, 2)
    check_parallel(make_config("tiny", overrides=["parallel=fsdp", "probe_every=0"]), 2)   # accepted
