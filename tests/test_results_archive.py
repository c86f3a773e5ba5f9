"""Every run folder committed under docs/notebook/results/ (in the folders' runs.tar.xz) still loads through
report.load_run, its attention spec still parses, its outcome still matches the committed tables,
and report.build_report still writes a page from a sample of them."""
from __future__ import annotations

import json
import math
import re
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from stableflash.model.spec import parse_attention_spec
from stableflash.report import build_report, explosion_step, load_run, loss_series

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "notebook" / "results"
ARCHIVES = 18           # folders with a runs.tar.xz
RUNS = 296              # run folders (holding metrics.jsonl) in them
# of them, written with config_version, per folder (the rest predate it)
CURRENT_GRAMMAR = {"faithful-gpt2-2026-11-24": 20, "laptop-repro-avx512-2026-11-29": 10}


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("results")
    archives = sorted(RESULTS.glob("*/runs.tar.xz"))
    assert len(archives) == ARCHIVES, [a.parent.name for a in archives]
    for archive in archives:
        with tarfile.open(archive) as tar:
            tar.extractall(out / archive.parent.name, filter="data")
    return out


@pytest.fixture(scope="module")
def run_dirs(unpacked) -> list[Path]:
    return sorted(m.parent for m in unpacked.rglob("metrics.jsonl"))


def test_every_run_loads(unpacked, run_dirs):
    assert len(run_dirs) == RUNS
    with_probes, empty, unstabilized, current = 0, [], 0, []
    for path in run_dirs:
        run = load_run(path)
        assert run.skipped == {} and run.problems == [], path
        assert run.config is not None, path
        if len(loss_series(run)[0]) == 0:
            empty.append(path.relative_to(unpacked).as_posix())
        with_probes += bool(run.probes)
        if "config_version" in json.loads((path / "config.json").read_text()):   # written in the current grammar
            current.append(path.relative_to(unpacked).parts[0])
            for source in (run.config, run.summary or {}):
                for key in ("attention", "final_attention"):
                    if source.get(key):
                        parse_attention_spec(source[key])
            continue
        assert "config_version" not in (run.summary or {}), path
        for source in (run.config, run.summary or {}):
            for key in ("attention", "final_attention"):
                if source.get(key):
                    # load_run upgrades the earlier grammar: a bare triton or emulated entry was
                    # unstabilized, and now says so by name
                    spec = parse_attention_spec(source[key])
                    entries = [re.sub(r"^\s*[\d*,\s-]+:", "", e).split() for e in source[key].split(";")]
                    assert all("stabilize=" in " ".join(e) for e in entries if e and e[0] != "sdpa"), source[key]
                    unstabilized += any(c.backend == "triton" and c.stabilize == "none"
                                        for c in (spec.default, *(c for _, c in spec.overrides)))
    assert with_probes == 260          # runs with probe records (the rest ran with probes off)
    assert Counter(current) == CURRENT_GRAMMAR
    assert unstabilized > 100          # the kernel baselines: "triton policy=..." in the earlier grammar
    # the one run that stopped before its first logged step (its metrics.jsonl was empty when archived)
    assert empty == ["mitigations-H200-2026-11-22/sess/m-sr-out/seed1/baseline"]


def _outcome_rows():
    rows = []
    for table in sorted(RESULTS.glob("*/outcomes.json")):
        for row in json.loads(table.read_text()):
            rows.append((table.parent.name, row))
    return rows


def test_outcomes_match_committed_tables(unpacked):
    """run_outcomes.py's row of every run in an outcomes.json, recomputed from the compact runs:
    steps, explosion step, warnings exactly, final and lowest loss to the table's 4 decimals."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "runs"))
    try:
        from run_outcomes import outcome
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "runs"))
    rows = _outcome_rows()
    assert len(rows) == 141
    for folder, row in rows:
        # the tables' run paths are relative to where the READMEs unpack the archive: "runs/..."
        # for an archive unpacked into runs/, "sess-g/..." for its own folders
        base = unpacked / folder
        run_dir = base / row["run"].removeprefix("runs/")
        got = outcome(run_dir, base)
        assert got["steps"] == row["steps"] and got["explosion_step"] == row["explosion_step"], (folder, row)
        assert got["warnings"] == row["warnings"] and got["first_warning"] == row["first_warning"], (folder, row)
        assert got["switches"] == row["switches"], (folder, row)
        for key in ("final_loss", "min_loss"):
            assert math.isclose(got[key], row[key], abs_tol=1e-9), (folder, row, key)


def test_rows_of_the_first_reproduction(unpacked):
    """The 14 runs of repro-kernel-paper-e8m5-H200 against the rows of its summary.json (written from
    the full runs): steps, explosion step and warnings exactly, lowest loss to its 4 decimals."""
    rows = json.loads((RESULTS / "repro-kernel-paper-e8m5-H200" / "summary.json").read_text())["rows"]
    assert len(rows) == 14
    for row in rows:
        run = load_run(unpacked / "repro-kernel-paper-e8m5-H200" / row["group"] / f"seed{row['seed']}" / row["run"])
        steps, losses = loss_series(run)
        assert int(steps[-1]) + 1 == row["steps"], row
        # since this table, explosion_step counts a run stopped on a non-finite step as exploded there
        nonfinite = [e["step"] for e in run.events if e.get("event") == "nonfinite"]
        expected = min(nonfinite) if row["status"] == "nonfinite" else row["explosion_step"]
        assert explosion_step(run) == expected, row
        assert len([e for e in run.events if e.get("event") == "monitor_warning"]) == row["warnings"], row
        assert abs(float(losses.min()) - row["min_loss"]) <= 5e-5, row


def test_report_from_a_sample(unpacked, tmp_path):
    sample = [unpacked / "repro-kernel-paper-e8m5-H200" / "e8m5-base" / "seed1" / "baseline",
              unpacked / "mitigations-H200-2026-11-24" / "x-fp8-switch-logit" / "seed1" / "baseline",
              unpacked / "cpu-fp8-2026-11-23e" / "e5m2-s0"]
    page = build_report(sample, tmp_path / "report.html")
    assert page.is_file() and page.stat().st_size > 10_000
    report = json.loads((tmp_path / "report.json").read_text())
    runs = report["runs"] if isinstance(report, dict) else report
    assert len(runs) == 3
    by_name = {Path(r["path"]).resolve(): r for r in runs}
    for path in sample:
        assert by_name[path.resolve()]["explosion_step"] == explosion_step(load_run(path))
    assert len(list(tmp_path.rglob("*.png"))) >= 4
