"""stableflash repro: the paired runs on one batch order, the verdict, the report."""
import json

import pytest

from stableflash.cli import main
from stableflash.repro import REPRO_PRESETS, run_repro
from stableflash.repro.run import verdict


def test_cpu_demo_paired_runs_share_their_batches_and_report(tmp_path):
    result = run_repro("cpu-demo", tmp_path, seeds=(0,), steps=12, progress=False)
    roles = [r["role"] for r in result["rows"]]
    assert roles == ["baseline", "stabilized", "control"]
    assert all(r["same_batches_as_baseline"] and r["steps"] == 12 for r in result["rows"])
    attn = {r["role"]: r["attention"] for r in result["rows"]}
    assert attn["stabilized"].endswith("rule=ours") and "out=fp32" in attn["control"]
    assert (tmp_path / "report.html").exists() and json.loads((tmp_path / "repro.json").read_text())["preset"] == "cpu-demo"
    assert "did not diverge" in result["verdict"]


def test_verdict_is_honest_about_every_case():
    base = {"role": "baseline", "seed": 0, "explosion_step": None}
    assert "did not diverge" in verdict([base])
    boom = dict(base, explosion_step=300)
    ok = {"role": "stabilized", "seed": 0, "explosion_step": None}
    assert "diverged in 1 of 1" in verdict([boom, ok]) and "did not" in verdict([boom, ok])
    both = {"role": "control", "seed": 0, "explosion_step": 500}
    assert "control (seed 0) also diverged at step 500" in verdict([boom, ok, both])


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
