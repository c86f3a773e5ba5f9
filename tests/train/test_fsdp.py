"""parallel=fsdp: two gloo ranks on CPU train through FSDP2 (fully_shard) the losses one process
trains with the same global batch; with ckpt_format=full they write the single-file checkpoint an
unsharded run writes, and by default a sharded one (torch.distributed.checkpoint), which resumes
bit for bit on two ranks and in one process, and which a one-process run's resumes on two ranks;
their probes (every rank unsharding the weights, rank 0 recording) are the one-process run's, and a
monitor rollback restores the sharded checkpoint and switches on every rank. A configuration FSDP
cannot run is a clear error."""
import json
import math
import shutil

import pytest
import torch

from stableflash.cli import main
from stableflash.model.presets import MODEL_PRESETS
from stableflash.train.config import make_config
from stableflash.train.loop import train
from stableflash.train.metrics import read_metrics
from tests.conftest import launch_ranks

FIXED = ("grad_accum=4", "device=cpu", "probe_every=0", "ckpt_every=3", "lr_decay_iters=6", "eval_every=3",
         "eval_iters=2")


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "event" not in r]


def last_per_step(run_dir):
    """{step: loss} of the last record of each step (a rollback repeats steps)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "event" not in r}


def torchrun(data_dir, out, *sets, resume=False):
    """`torchrun --standalone --nproc_per_node=2 -m stableflash.cli train ...` on two CPU ranks
    (``launch_ranks``)."""
    argv = ["train", "-q"] + (["--resume", str(out)] if resume else ["--preset", "tiny", "--out", str(out)])
    for s in (f"data={data_dir}", "parallel=fsdp", *FIXED, *sets):
        argv += ["--set", s]
    launch_ranks(argv)


@pytest.mark.slow
def test_fsdp_two_ranks_train_and_write_full_checkpoints_like_one_process(data_dir, tmp_path):
    one = make_config("tiny", overrides=[f"data={data_dir}", *FIXED, "max_iters=6"])
    single = train(one, tmp_path / "one", progress=False)
    torchrun(data_dir, tmp_path / "two", "max_iters=3", "ckpt_format=full")
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
    # the one-process checkpoint of step 3 resumes on two FSDP ranks (loaded into the shards) to the same losses
    torchrun(data_dir, tmp_path / "ref", "max_iters=6", "ckpt_format=full", resume=True)
    a, b = losses(tmp_path / "one"), losses(tmp_path / "ref")
    assert single["status"] == "finished" and len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)
    assert a[0] > a[-1] + 0.3                             # it trains: the comparison is not of constants
    # the two ranks' checkpoint resumes in one process (the format is the one unsharded runs use)
    summary = train(make_config("tiny", overrides=[f"data={data_dir}", *FIXED, "max_iters=6"]),
                    tmp_path / "two", resume=True, progress=False)
    assert summary["status"] == "finished" and summary["steps"] == 6
    assert max(abs(x - y) for x, y in zip(a, losses(tmp_path / "two"))) < 1e-4


# probes every step. A first leg to step 2 with a threshold no logit reaches writes the checkpoint of step 2;
# resumed with MONITORED, whose 0.01 every layer's largest logit is above at any probe (the tiny model's are
# 0.1-0.3 by then, on whichever Python's standard library the embedded corpus is read from), the monitor
# warns at step 2 in both layers, rolls back to the checkpoint of step 2 and switches both to P-bar in e2m1,
# which moves the loss by ~5e-4: far above the 2e-5 the two-rank and one-process runs differ by. Switched
# layers are not acted on again, so no rollback follows and a stop at step 3 resumes bit for bit.
MONITORED = ("probe_every=1", "ckpt_every=2", "warmup_iters=1", "monitor=rollback", "monitor_max_logit=0.01",
             "monitor_patience=1", "monitor_switch_to=p_bar=e2m1", "ckpt_format=sharded")


def _flat(record, prefix=""):
    if isinstance(record, dict):
        for key, value in record.items():
            yield from _flat(value, f"{prefix}.{key}")
    elif isinstance(record, list):
        for i, value in enumerate(record):
            yield from _flat(value, f"{prefix}[{i}]")
    else:
        yield prefix, record


# the row statistics that count rows (or entries per row) against a threshold, over the probe's rows: the
# tiny preset's probe_seqs sequences of block_size tokens; the sink fractions count over the rows that see two
# keys or more (all but each sequence's first), the fewest rows of any, so one row's largest share
COUNTS = (".row.repeated_max_frac", ".row.pbar_one_count", ".row.sink_frac", ".row.sink_repeated_frac")
PROBE_ROWS = make_config("tiny").probe_seqs * (MODEL_PRESETS["tiny"].block_size - 1)


def assert_same_probes(got_dir, want_dir):
    """probes.jsonl of two runs: the same records; floats to 1e-4 (relative or absolute: the runs add in
    another order), integers and None exactly; the probes' own timing aside. A count of rows against a
    threshold (``COUNTS``: a second score within eps of the row's maximum, P̄ rounding to 1) is a multiple
    of one row's share, so two runs whose weights differ in their last bits can differ by a row whose
    score lies that close to the threshold: each such value within one row (1 / ``PROBE_ROWS``)."""
    got = [dict(_flat(json.loads(line))) for line in (got_dir / "probes.jsonl").read_text().splitlines()]
    want = [dict(_flat(json.loads(line))) for line in (want_dir / "probes.jsonl").read_text().splitlines()]
    assert len(got) == len(want) > 4 and [g.keys() for g in got] == [w.keys() for w in want]
    for g, w in zip(got, want):
        for key, value in w.items():
            if key == ".probe_ms":
                continue
            if isinstance(value, float) and key.startswith(COUNTS):
                assert abs(g[key] - value) <= 1 / PROBE_ROWS + 1e-12, (w[".step"], key, g[key], value)
            elif isinstance(value, float):
                assert math.isclose(g[key], value, rel_tol=1e-4, abs_tol=1e-4), (w[".step"], key, g[key], value)
            else:
                assert g[key] == value, (w[".step"], key, g[key], value)


def monitor_actions(run_dir):
    """[(step, action, layers)] of a run's monitor records, in order."""
    return [(r["step"], r["action"], r["layers"]) for r in read_metrics(run_dir / "metrics.jsonl")
            if r.get("event") == "monitor_action"]


@pytest.mark.slow
def test_fsdp_sharded_checkpoints_probes_and_monitor_rollback(data_dir, tmp_path):
    sets = [f"data={data_dir}", *FIXED, *MONITORED]
    # one process to step 2 (a sharded checkpoint of one shard; no logit reaches the threshold), then on to
    # step 6 with MONITORED's: the reference
    ref = tmp_path / "one"
    train(make_config("tiny", overrides=[*sets, "max_iters=2", "monitor_max_logit=1000"]), ref, progress=False)
    assert monitor_actions(ref) == []
    shutil.copytree(ref, tmp_path / "two")
    shutil.copytree(ref, tmp_path / "cut")
    train(make_config("tiny", overrides=[*sets, "max_iters=6"]), ref, resume=True, progress=False)
    want = last_per_step(ref)
    before = [r["loss"] for r in read_metrics(ref / "metrics.jsonl") if r.get("step") == 2 and "event" not in r]
    assert len(before) == 2 and abs(before[0] - before[1]) > 3e-4      # the rollback's switch shows in the loss

    # 1 -> 2 ranks: resumed on two FSDP ranks, rolled back through the one-process checkpoint and switched
    # on both ranks: the one-process losses, every record of them, and its probes
    torchrun(data_dir, tmp_path / "two", "max_iters=6", "parallel=fsdp", *MONITORED, resume=True)
    two = tmp_path / "two"
    got = [r["loss"] for r in read_metrics(two / "metrics.jsonl") if "event" not in r]
    ref_all = [r["loss"] for r in read_metrics(ref / "metrics.jsonl") if "event" not in r]
    assert len(got) == len(ref_all) == 7 and max(abs(x - y) for x, y in zip(got, ref_all)) < 2e-5, (got, ref_all)
    assert monitor_actions(two) == monitor_actions(ref) == [(2, "rollback", [0, 1]), (2, "switch", [0, 1])]
    assert_same_probes(two, ref)
    assert sorted(p.name for p in (two / "ckpt" / "step-6").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (two / "ckpt.pt").exists() and [p.name for p in (two / "ckpt").iterdir()] == ["step-6"]

    # 2 ranks -> 2 ranks: stopped at step 3 and resumed, bit for bit the uninterrupted two-rank losses
    cut = tmp_path / "cut"
    torchrun(data_dir, cut, "max_iters=3", "parallel=fsdp", *MONITORED, resume=True)
    shutil.copytree(cut, tmp_path / "cut1")
    torchrun(data_dir, cut, "max_iters=6", "parallel=fsdp", *MONITORED, resume=True)
    assert last_per_step(cut) == last_per_step(two)
    # 2 ranks -> 1 process: the two ranks' sharded checkpoint of step 3, resharded into one model
    train(make_config("tiny", overrides=[*sets, "max_iters=6"]), tmp_path / "cut1", resume=True, progress=False)
    one = last_per_step(tmp_path / "cut1")
    assert one.keys() == want.keys() and max(abs(one[k] - want[k]) for k in want) < 2e-5, (one, want)


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


def test_what_fsdp_cannot_run_with_is_named():
    from stableflash.train.config import check_parallel
    cfg = make_config("tiny", overrides=["parallel=fsdp", "dtype=fp16"])
    with pytest.raises(ValueError, match="dtype=fp16 cannot apply with parallel=fsdp"):
        check_parallel(cfg, 2)
    for sets in (["probe_every=100", "monitor=switch"], ["monitor=rollback", "ckpt_format=full"]):   # accepted
        check_parallel(make_config("tiny", overrides=["parallel=fsdp", *sets]), 2)
