"""stableflash repro: the paired runs on one batch order, the verdict, the report."""
import json
from pathlib import Path

import pytest

from stableflash.cli import main
from stableflash.repro import REPRO_PRESETS, run_repro
from stableflash.repro.run import verdict
from tests.conftest import made_once


@pytest.fixture(scope="session")
def cpu_demo(shared_tmp):
    """(folder, result) of the cpu-demo reproduction of seeds 0 and 1 for 6 steps, the runs one after
    another, made once for the run (``made_once``) and read by the two tests below and by the Ctrl-C
    test (its seed-0 baseline is the uninterrupted run there)."""
    folder = shared_tmp / "cpu-demo-repro-6-steps"
    return folder, made_once(folder, lambda out: run_repro("cpu-demo", out, seeds=(0, 1), steps=6, progress=False))


def test_cpu_demo_paired_runs_share_their_batches_and_report(cpu_demo):
    """The three runs of each seed on one batch order, the δ source the table names, the report. The
    reproduction is the shared two-seed one of 6 steps: cpu-demo probes at step 0 and neither
    evaluates nor checkpoints before step 100, so longer runs take no other path."""
    folder, result = cpu_demo
    for seed in (0, 1):
        roles = [r["role"] for r in result["rows"] if r["seed"] == seed]
        assert roles == ["baseline", "stabilized", "control"]
    assert all(r["same_batches_as_baseline"] and r["steps"] == 6 for r in result["rows"])
    attn = {r["role"]: r["attention"] for r in result["rows"]}
    assert attn["stabilized"].endswith("stabilize=consistent-delta") and "stabilize=none" in attn["baseline"]
    assert "out=fp32" in attn["control"] and "stabilize=none" in attn["control"]
    # the table says which δ source the consistent δ ran (the preset's rounding picks it)
    import torch

    from stableflash.attention.policy import consistent_delta_source, resolve_policy
    from stableflash.model.spec import parse_attention_spec
    from stableflash.repro.run import format_table
    choice = parse_attention_spec(attn["stabilized"]).default
    source = consistent_delta_source(resolve_policy(choice.policy, torch.bfloat16))
    assert choice.delta_source() == source
    assert {r["role"]: r["consistent_delta"] for r in result["rows"]} == {"baseline": [], "stabilized": [source],
                                                                           "control": []}
    stabilized_line = next(line for line in format_table(result).splitlines() if " stabilized " in line)
    assert stabilized_line.endswith(f"{attn['stabilized']} (δ: {source})")
    assert (folder / "report.html").exists() and json.loads((folder / "repro.json").read_text())["preset"] == "cpu-demo"
    assert "did not diverge" in result["verdict"]


@pytest.mark.slow
def test_parallel_runs_match_the_sequential_ones(tmp_path, cpu_demo):
    """--parallel runs the same trainings in worker processes: same losses, same batches, same order
    (the sequential runs: the shared reproduction)."""
    _, one = cpu_demo
    two = run_repro("cpu-demo", tmp_path / "par", seeds=(0, 1), steps=6, progress=False, parallel=2)
    assert [(r["seed"], r["role"]) for r in two["rows"]] == [(r["seed"], r["role"]) for r in one["rows"]]
    for a, b in zip(one["rows"], two["rows"]):
        assert b["same_batches_as_baseline"] and b["steps"] == 6
        assert b["final_loss"] == pytest.approx(a["final_loss"], rel=1e-6), (a["seed"], a["role"])
    with pytest.raises(ValueError, match=r"parallel=0 is invalid; accepted: an int >= 1"):
        run_repro("cpu-demo", tmp_path / "bad", parallel=0)
    with pytest.raises(ValueError, match=r"roles=\['base'\] is invalid; accepted: one or more of baseline"):
        run_repro("cpu-demo", tmp_path / "bad", roles=("base",))


def test_roles_select_the_runs(tmp_path):
    result = run_repro("cpu-demo", tmp_path, seeds=(0,), steps=3, progress=False, roles=("baseline",))
    assert [r["role"] for r in result["rows"]] == ["baseline"]
    assert not (tmp_path / "seed0" / "control").exists()


def test_a_set_attention_is_what_the_rows_name(tmp_path):
    # the mitigation runs replace the baseline's attention with --set attention=...: the table must
    # name the attention that ran, not the role's
    spec = "emulated policy=paper acc=e8m5 row_sum=e8m5 out=e8m5 stabilize=paper beta=4"
    result = run_repro("cpu-demo", tmp_path, seeds=(0,), steps=2, progress=False, roles=("baseline",),
                       extra=(f"attention={spec}",))
    ran = json.loads((tmp_path / "seed0" / "baseline" / "config.json").read_text())["attention"]
    assert result["rows"][0]["attention"] == ran == spec


def test_verdict_is_honest_about_every_case():
    base = {"role": "baseline", "seed": 0, "explosion_step": None}
    assert "did not diverge" in verdict([base])
    boom = dict(base, explosion_step=300)
    ok = {"role": "stabilized", "seed": 0, "explosion_step": None}
    assert "diverged in 1 of 1" in verdict([boom, ok]) and "did not" in verdict([boom, ok])
    assert verdict([boom, ok]).endswith("the stabilized run did not (the fp32 control not run).")
    assert verdict([boom]).endswith("(the stabilized run and the fp32 control were not run).")
    both = {"role": "control", "seed": 0, "explosion_step": 500}
    assert "control (seed 0) also diverged at step 500" in verdict([boom, ok, both])
    assert verdict([ok]) == "No baseline was run (roles without it): none of the 1 run(s) diverged."
    assert verdict([ok, both]) == "No baseline was run (roles without it): control (seed 0) diverged at step 500."


def test_cli_repro_bad_preset_and_gpu_presets(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["repro", "--preset", "huge", "--no-probe"])
    assert exc.value.code == 2 and "'huge' is unknown" in capsys.readouterr().err
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            main(["repro", "--preset", "leads-e8m5", "--no-probe"])
        assert "needs a GPU" in capsys.readouterr().err
    assert REPRO_PRESETS["leads-e8m5"].accelerated and not REPRO_PRESETS["leads-bf16"].accelerated


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "-1"], "seed=-1 is invalid; accepted: a non-negative integer"),
    (["--steps", "0"], "max_iters=0 is invalid; accepted: a positive integer"),
    (["--set", "lr=abc"], "lr='abc' is not a valid float"),
    (["--parallel", "0"], "parallel=0 is invalid; accepted: an int >= 1"),
])
def test_cli_repro_refuses_bad_input_before_the_probe(monkeypatch, tmp_path, capsys, argv, message):
    """The README's command with a bad argument: refused with what is accepted before the kernel-level
    probe runs, and no output folder written."""
    from stableflash.diagnostics import mechanism
    monkeypatch.setattr(mechanism, "run_probe", lambda *a, **k: pytest.fail("the probe ran before the check"))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(["repro", "--preset", "cpu-fp8-tiny", "--out", str(out), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("name", sorted(REPRO_PRESETS))
def test_every_preset_builds_its_three_runs(name):
    """Each role's config is valid before any GPU time is spent; the control holds Ō, ℓ and O (and,
    on the emulated backend, P̄) in fp32 with the baseline's scores and its δ not from a bf16 O; the
    stabilized run is the baseline as ``stabilize=True`` runs it — the standard row maximum, δ from
    the guard's source for its rounding (dP·P on "paper" policies, the 16-bit product's O on fp8 P̄,
    O as computed otherwise, both kept as the stored O plus its residual) — nothing else changed."""
    from stableflash.model import parse_attention_spec
    from stableflash.train.config import make_config
    p = REPRO_PRESETS[name]
    choices = {}
    for role, attention in p.attentions().items():
        cfg = make_config(p.train_preset, overrides=[*p.overrides, f"attention={attention}"])
        choices[role] = parse_attention_spec(cfg.attention).default
    from stableflash.attention.policy import consistent_delta_source, resolve_policy
    from stableflash.numerics import get_format
    import torch
    pol = resolve_policy(choices["control"].policy, torch.bfloat16)
    assert (pol.acc, pol.row_sum, pol.out) == ("fp32",) * 3
    if choices["control"].backend == "triton":
        assert pol.p_bar == "bf16" and pol.delta == "recompute_fp32"
    else:
        assert pol.p_bar == "fp32"
    assert choices["stabilized"].stabilize == "consistent-delta" and choices["baseline"].stabilize == "none"
    assert choices["control"].stabilize == "none"
    base = resolve_policy(choices["baseline"].policy, torch.bfloat16)
    stab = choices["stabilized"].stabilization.policy_for(resolve_policy(choices["stabilized"].policy, torch.bfloat16))
    assert stab == base.replace(delta=consistent_delta_source(base), name=stab.name)
    want = "dP·P" if base.scores != "fp32" or base.acc != "fp32" else "dO·(O16+R)" if base.p_bar.startswith("fp8") \
        else "dO·(O+R)"
    assert consistent_delta_source(base) == want
    assert pol.scores == resolve_policy(choices["baseline"].policy, torch.bfloat16).scores
    narrowest = min(get_format(getattr(base, f)).man_bits for f in ("p_bar", "acc", "row_sum", "out"))
    assert (p.accelerated is not None) == (narrowest < 7)


def test_ladder_rungs_are_the_papers_experiments():
    from stableflash.model import parse_attention_spec
    from stableflash.repro.ladder import rungs
    r = rungs("emulated policy=paper", layer=2, heads=[1, 7], seq_len=512)
    assert r["tiling off (block = sequence)"] == "emulated policy=paper block=512"
    assert r["failing attention in layer 2 only"] == "sdpa; 2: emulated policy=paper"
    assert r["SDPA in layer 2 only"] == "emulated policy=paper; 2: sdpa"
    assert parse_attention_spec(r["δ from dP·P"]).default.policy.delta == "dP·P"
    assert parse_attention_spec(r["O recomputed in fp32 for δ"]).default.policy.delta == "recompute_fp32"
    fwd = parse_attention_spec(r["O in fp32 (forward)"]).default.policy
    assert (fwd.acc, fwd.row_sum, fwd.out, fwd.p_bar) == ("fp32", "fp32", "fp32", "bf16")
    heads = parse_attention_spec(r["O in fp32 for heads 1,7 of layer 2"])
    assert heads.choice(2).policy.hp_heads == (1, 7) and heads.choice(0).policy == "paper"
    only = parse_attention_spec(r["only Ō = P̄V in fp32"]).default.policy
    assert (only.p_bar, only.acc, only.out) == ("fp32", "fp32", "bf16")
    with pytest.raises(ValueError, match="one attention for every layer"):
        rungs("sdpa; 1: emulated policy=paper", 1, [0], 64)


def test_ladder_rungs_of_a_narrowed_policy_replace_its_settings():
    """The accelerated baselines set acc/row_sum/out already: a rung sets them anew (a spec that named
    a key twice would be rejected)."""
    from stableflash.model import parse_attention_spec
    from stableflash.repro.ladder import rungs
    r = rungs("emulated policy=paper acc=e8m5 row_sum=e8m5 out=e8m5", layer=1, heads=[0], seq_len=512)
    fwd = parse_attention_spec(r["O in fp32 (forward)"]).default.policy
    assert (fwd.acc, fwd.row_sum, fwd.out) == ("fp32", "fp32", "fp32")
    only = parse_attention_spec(r["only Ō = P̄V in fp32"]).default.policy
    assert (only.p_bar, only.acc, only.row_sum, only.out) == ("fp32", "fp32", "e8m5", "e8m5")
    assert all(parse_attention_spec(v) for v in r.values())


def test_ladder_on_the_kernels_moves_only_what_they_cannot_run_to_the_emulation():
    pytest.importorskip("triton")
    from stableflash.model import parse_attention_spec
    from stableflash.repro.ladder import rungs
    r = rungs("triton policy=paper acc=e8m5 row_sum=e8m5 out=e8m5", layer=1, heads=[0, 2], seq_len=512)
    on = {name: parse_attention_spec(text) for name, text in r.items()}
    kernel = {n for n, s in on.items() if all(c.backend in ("triton", "sdpa") for c in s.choices(6))}
    assert kernel == set(on)                    # tiling off too: a key block of 512 under "paper"
    assert on["tiling off (block = sequence)"].default.block == 512
    long = rungs("triton policy=paper", layer=1, heads=[0], seq_len=1024)    # beyond the kernels' 512
    assert parse_attention_spec(long["tiling off (block = sequence) [emulated backend]"]).default.backend == "emulated"
    fa2 = rungs("triton policy=fa2 out=e8m4", layer=1, heads=[0], seq_len=512)  # a key block only under "paper"
    assert parse_attention_spec(fa2["tiling off (block = sequence) [emulated backend]"]).default.block == 512
    fp32 = on["O in fp32 (forward)"].default.policy           # the kernels keep an fp32 O for δ
    assert (fp32.acc, fp32.row_sum, fp32.out, fp32.delta) == ("fp32", "fp32", "fp32", "dO·O")
    heads = on["O in fp32 for heads 0,2 of layer 1"]
    assert heads.choice(0).backend == "triton" and heads.choice(1).backend == "triton"
    assert heads.choice(1).policy.hp_heads == (0, 2) and heads.choice(1).policy.acc == "e8m5"
    assert heads.choice(0).policy.hp_heads == ()
    pv = on["only Ō = P̄V in fp32"].default.policy
    assert (pv.p_bar, pv.acc, pv.row_sum, pv.out) == ("fp32", "fp32", "e8m5", "e8m5")
    assert on["δ from dP·P"].default.policy.delta == "dP·P" and on["δ from dP·P"].default.policy.out == "e8m5"
    # what the kernels still cannot take goes to the emulation: heads above 30
    assert "[emulated backend]" in next(n for n in rungs("triton policy=paper acc=e8m5 row_sum=e8m5 out=e8m5",
                                                         layer=0, heads=[31], seq_len=64) if "heads" in n)


@pytest.fixture(scope="session")
def ladder(shared_tmp):
    """(folder, result) of the cpu-demo ladder trained for 3 steps, one rung after another, once for
    the run (``made_once``): the sequential ladder that the tests below read (and one copies before
    it removes a rung)."""
    from stableflash.repro.ladder import run_ladder
    folder = shared_tmp / "cpu-demo-ladder-3-steps"
    return folder, made_once(folder, lambda out: run_ladder("cpu-demo", out, steps=3, progress=False))


@pytest.mark.slow
def test_ladder_rungs_in_parallel_match_the_sequential_ladder(tmp_path, ladder):
    from stableflash.repro.ladder import run_ladder
    _, one = ladder
    two = run_ladder("cpu-demo", tmp_path / "par", steps=3, progress=False, parallel=2)
    assert [r["rung"] for r in one["rows"]] == [r["rung"] for r in two["rows"]]
    assert [r["final_loss"] for r in one["rows"]] == [r["final_loss"] for r in two["rows"]]
    with pytest.raises(ValueError, match="parallel=0 is invalid"):
        run_ladder("cpu-demo", tmp_path / "bad", steps=3, progress=False, parallel=0)


def test_ladder_runs_every_rung_on_the_same_batches(ladder):
    """Every rung of the ladder (the shared 3-step one) read the baseline's batches, step for step."""
    folder, result = ladder
    assert len(result["rows"]) == 9 and all(r["steps"] == 3 for r in result["rows"])
    batches = {(folder / r["run_dir"].split("/")[-1] / "batches" / "rank0.bin").read_bytes() for r in result["rows"]}
    assert len(batches) == 1
    assert (folder / "ladder.json").exists()


def test_ladder_reuses_finished_runs_of_the_same_config_only(tmp_path, ladder):
    """A stopped ladder continues: rungs already finished (same config) are read, not retrained;
    a folder holding another config's run is not taken for the rung. The finished ladder is a copy
    of the shared one (a ladder's folder moves with its runs: nothing in it names the folder)."""
    import shutil

    from stableflash.repro.ladder import finished_run, run_ladder
    from stableflash.train.config import make_config
    folder, first = ladder
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    runs = [tmp_path / r["run_dir"].split("/")[-1] for r in first["rows"]]
    rung = runs[2]
    shutil.rmtree(rung)                                        # as if stopped before this rung ran
    stamps = {d: (d / "summary.json").stat().st_mtime_ns for d in runs if d.exists()}
    again = run_ladder("cpu-demo", tmp_path, steps=3, progress=False)
    assert [r["final_loss"] for r in again["rows"]] == [r["final_loss"] for r in first["rows"]]
    assert [Path(r["run_dir"]) for r in again["rows"]] == runs
    assert all((d / "summary.json").stat().st_mtime_ns == t for d, t in stamps.items())
    assert (rung / "summary.json").exists()
    cfg = json.loads((rung / "config.json").read_text())
    same = make_config("tiny", overrides=[f"{k}={v}" for k, v in cfg.items() if k in ("seed",)])
    assert finished_run(rung, same) is None                    # another config: not this run
    with pytest.raises(ValueError, match="already holds a run"):
        run_ladder("cpu-demo", tmp_path, steps=4, progress=False)   # 4 steps: not the 3-step runs


def test_the_default_without_a_gpu_is_the_fast_fp8_failure(monkeypatch):
    """Without a GPU, `stableflash repro` runs cpu-fp8-tiny: an accelerated preset (labelled, with
    what bf16 did beside it) whose stabilized run is what flash_attention(stabilize=True) computes
    for the baseline's attention — outputs and gradients bit for bit — and whose control holds P̄,
    Ō, ℓ and O in fp32."""
    import torch
    from stableflash.attention import flash_attention
    from stableflash.attention.policy import resolve_policy
    from stableflash.model import parse_attention_spec
    from stableflash.repro import default_preset
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_preset() == "cpu-fp8-tiny"
    p = REPRO_PRESETS["cpu-fp8-tiny"]
    assert not p.gpu and "fp8 e5m2" in p.accelerated and p.faithful
    choice = {role: parse_attention_spec(a).default for role, a in p.attentions().items()}
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 64, 32) * 3 for _ in range(3))        # the tiny model's heads and context
    do = torch.randn(2, 2, 64, 32)

    def run(**kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*leaves, causal=True, **kw)
        out.backward(do)
        return [out.detach(), *(t.grad for t in leaves)]

    stabilized = run(**choice["stabilized"].kwargs())
    as_stabilize_true = run(**{**choice["baseline"].kwargs(), "stabilize": True})
    baseline = run(**choice["baseline"].kwargs())
    for a, b in zip(stabilized, as_stabilize_true):
        assert torch.equal(a, b)
    assert torch.equal(stabilized[0], baseline[0]) and not torch.equal(stabilized[1], baseline[1])   # δ differs
    control = resolve_policy(choice["control"].policy, torch.float32)
    assert (control.p_bar, control.acc, control.row_sum, control.out) == ("fp32",) * 4


def test_the_cli_default_runs_the_three_runs_and_names_the_acceleration(monkeypatch, tmp_path, capsys):
    """`stableflash repro` with no preset, as a user runs it (a few steps, no probe)."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["repro", "--no-probe", "-q", "--steps", "3", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("stableflash repro — preset cpu-fp8-tiny: a 2-layer byte-level GPT")
    assert lines[1] == "ACCELERATED (not bf16): P̄ and O rounded to fp8 e5m2 (2 mantissa bits instead of bf16's 7)"
    result = json.loads((tmp_path / "repro.json").read_text())
    assert [(r["role"], r["steps"], r["same_batches_as_baseline"]) for r in result["rows"]] == [
        ("baseline", 3, True), ("stabilized", 3, True), ("control", 3, True)]
    assert lines[-2] == result["verdict"] == (
        "The baseline did not diverge in any of 1 seed(s): no explosion reproduced with this configuration. "
        "Accelerated: P̄ and O rounded to fp8 e5m2 (2 mantissa bits instead of bf16's 7), a stand-in for bf16, "
        "which did not fail in 8000 steps of the same run (docs/reproduction.md).")


def test_the_accelerated_note_is_left_out_when_set_replaces_the_attention(tmp_path):
    """The verdict's "Accelerated: …" sentence describes the preset's own attentions; a run whose
    attention --set replaced (here the baseline in bf16) is not called accelerated."""
    result = run_repro("cpu-fp8-tiny", tmp_path, seeds=(0,), steps=2, progress=False, roles=("baseline",),
                       extra=("attention=emulated policy=fa2", "probe_every=0"))
    assert result["rows"][0]["attention"] == "emulated policy=fa2"
    assert result["verdict"] == ("The baseline did not diverge in any of 1 seed(s): no explosion reproduced with "
                                 "this configuration.")
    p = REPRO_PRESETS["cpu-fp8-tiny"]
    rows = [{"role": "baseline", "seed": 0, "explosion_step": 4630, "attention": p.baseline}]
    assert verdict(rows, p) == ("The baseline diverged in 1 of 1 seed(s) (steps 4630) (the stabilized run and the "
                                "fp32 control were not run). Accelerated: P̄ and O rounded to fp8 e5m2 (2 mantissa "
                                "bits instead of bf16's 7), a stand-in for bf16, which did not fail in 8000 steps of "
                                "the same run (docs/reproduction.md).")


def test_the_stabilized_run_takes_any_stabilization_by_name():
    import dataclasses

    from stableflash.model.spec import parse_attention_spec
    from stableflash.repro.presets import REPRO_PRESETS
    p = dataclasses.replace(REPRO_PRESETS["cpu-demo"], stabilization="tie-shift+consistent-delta")
    assert parse_attention_spec(p.stabilized).default.stabilize == "tie-shift+consistent-delta"
    assert parse_attention_spec(p.baseline).default.stabilize == "none"
    with pytest.raises(ValueError, match="stabilization='ours' is invalid \\('ours' is the earlier name of 'tie-shift'\\)"):
        dataclasses.replace(REPRO_PRESETS["cpu-demo"], stabilization="ours")


def test_a_repro_interrupted_by_ctrl_c_resumes_when_run_again(tmp_path, monkeypatch, ctrl_c, cpu_demo):
    """Ctrl-C during a reproduction saves the run (status "interrupted"); running the same command
    again resumes it from its checkpoint to the losses of an uninterrupted reproduction (the shared
    one's seed-0 baseline: the same run, with the same config), instead of refusing the folder."""
    import os
    import signal

    from stableflash.train import loop
    _, shared = cpu_demo
    (straight,) = [r for r in shared["rows"] if (r["seed"], r["role"]) == (0, "baseline")]
    real_lr_at = loop.lr_at

    def lr_at(step, cfg):
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)
        return real_lr_at(step, cfg)

    monkeypatch.setattr(loop, "lr_at", lr_at)
    with pytest.raises(KeyboardInterrupt):
        run_repro("cpu-demo", tmp_path / "r", seeds=(0,), steps=6, progress=False, roles=("baseline",))
    run_dir = tmp_path / "r" / "seed0" / "baseline"
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    monkeypatch.setattr(loop, "lr_at", real_lr_at)
    again = run_repro("cpu-demo", tmp_path / "r", seeds=(0,), steps=6, progress=False, roles=("baseline",))
    assert again["rows"][0]["status"] == "finished"
    assert again["rows"][0]["final_loss"] == straight["final_loss"]
