"""The run report: loading run folders, the explosion rule, the figures and the HTML page.

Every run folder here is synthetic, written by ``write_run`` below (no training involved):
"exploding" has its loss falling to ≈2, creeping up from step 250 and jumping to 5× its minimum
at step 300 (NaN at step 400), repeated maxima rising in layer 1 from step 200, layer 1's W_q
growing, a monitor warning at step 250 and a non-finite event at 400; "stable" just converges.
"""
from __future__ import annotations

import base64
import io
import json
import math
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402  (matplotlib depends on Pillow)

from stableflash.report import (build_report, delta_series, explosion_step, load_run, metric_series,  # noqa: E402
                                probe_series, to_float)
from stableflash.report import plots  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LAYERS, HEADS, LAST_STEP, PROBE_EVERY = 3, 2, 400, 10
HOSTILE = '<script>alert("x")</script>'


# ------------------------------------------------------------------------------------ the fixtures

def _loss(kind: str, step: int, rng: np.random.Generator) -> float:
    """≈2 after step 200 for both; "exploding" creeps to 2.5 over steps 250-299, then jumps to
    10 (5× its minimum) at step 300 and is NaN at the last step. ±1.5% noise keeps every pre-300
    loss below 2 × running minimum (≥ 3.9) and every later one above it."""
    if kind == "exploding" and step == LAST_STEP:
        return math.nan
    base = 2.0 + 8.0 * math.exp(-step / 40)
    if kind == "exploding" and step >= 300:
        base = 10.0 + 0.05 * (step - 300)
    elif kind == "exploding" and step >= 250:
        base *= 1.0 + 0.25 * (step - 250) / 50
    return base * (1.0 + 0.005 * float(np.clip(rng.standard_normal(), -3, 3)))


def _probe(kind: str, step: int, rng: np.random.Generator) -> dict:
    grow = kind == "exploding" and step > 200

    def per_head(base):
        return [[base * (1 + 0.05 * layer) + 0.1 * head for head in range(HEADS)] for layer in range(LAYERS)]

    q_full = [5.0 + 0.005 * step + layer for layer in range(LAYERS)]
    q_head = per_head(3.0 + 0.003 * step)
    if grow:                                  # layer 1's query projection grows after step 200
        q_full[1] = 6.0 * math.exp((step - 200) / 60)
        q_head[1] = [0.7 * q_full[1] + head for head in range(HEADS)]
    frac = [[0.01 + 0.005 * rng.random() for _ in range(HEADS)] for _ in range(LAYERS)]
    if kind == "exploding" and step >= 200:  # repeated maxima rise in layer 1 from step 200
        frac[1] = [min(0.9, 0.02 + 0.5 * (step - 200) / 200 + 0.02 * h) for h in range(HEADS)]
    walk = 0.05 * rng.standard_normal()
    drift = -0.02 * max(0, step - 200) if kind == "exploding" else 0.0
    record = {
        "step": step,
        "spectral": {"q": q_head, "k": per_head(2.5), "v": per_head(1.5), "o": per_head(1.2),
                     "q_full": q_full, "k_full": [4.0] * LAYERS, "v_full": [2.0] * LAYERS, "o_full": [1.5] * LAYERS},
        "row": {"repeated_max_frac": frac,
                "pbar_one_count": [[int(100 * f) for f in row] for row in frac],
                "max_logit": [[10.0 + 0.01 * step] * HEADS for _ in range(LAYERS)]},
        "delta": {str(layer): {"per_token_mean": 1e-4 * walk, "sum_over_tokens": walk,
                               "sum_over_tokens_per_head": [walk / HEADS] * HEADS, "sign_agreement_max": 0.55,
                               "running_sum": (walk + drift * (layer == 1)) * (1 + step / 100)}
                  for layer in (0, 1)},
    }
    return record


def write_run(root: Path, name: str, kind: str, *, probes: bool = True, config: bool = True,
              summary: bool = True, attention: str | None = None, notes: str = "") -> Path:
    """A synthetic run folder ``root/name`` of the ``kind`` "exploding" or "stable"."""
    rng = np.random.default_rng(0 if kind == "exploding" else 1)
    path = root / name
    path.mkdir(parents=True)
    lines, best_val = [], math.inf
    for step in range(LAST_STEP + 1):
        loss = _loss(kind, step, rng)
        grad = 0.8 + 0.1 * rng.random() + (0.05 * (step - 250) if kind == "exploding" and step > 250 else 0.0)
        record = {"step": step, "loss": loss if math.isfinite(loss) else "nan", "lr": 1e-3,
                  "grad_norm": grad if math.isfinite(loss) else "inf", "ms": 12.0, "tokens_per_s": 40000.0}
        if (step + 1) % 50 == 0:
            record["val_loss"] = loss + 0.1 if math.isfinite(loss) else "nan"
            if math.isfinite(loss):
                best_val = min(best_val, loss + 0.1)
        lines.append(record)
        if kind == "exploding" and step == 250:
            lines.append({"step": 250, "loss": loss, "event": "monitor_warning", "layer": 1, "head": 0,
                          "indicator": "repeated_max_frac", "value": 0.27,
                          "message": "layer 1 head 0: repeated maxima rising"})
        if kind == "exploding" and step == 260:
            lines.append({"step": 260, "loss": loss, "event": "monitor_action", "action": "switch", "layers": [1]})
    if kind == "exploding":
        lines.append({"step": LAST_STEP, "loss": "nan", "event": "nonfinite", "message": "loss is nan at step 400"})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if probes:
        (path / "probes.jsonl").write_text("".join(
            json.dumps(_probe(kind, step, rng)) + "\n" for step in range(0, LAST_STEP, PROBE_EVERY)))
    if config:
        attention = attention or ("flash-bf16" if kind == "exploding" else "stable-flash")
        (path / "config.json").write_text(json.dumps({
            "model": "tiny", "attention": attention, "optimizer": "adamw", "lr": 1e-3, "seed": 0,
            "dtype": "bf16", "notes": notes}))
    if summary:
        (path / "summary.json").write_text(json.dumps({
            "status": "nonfinite" if kind == "exploding" else "finished", "steps": LAST_STEP + 1,
            "final_loss": math.nan if kind == "exploding" else lines[-1]["loss"],
            "best_val_loss": best_val, "attention": attention}))   # json writes NaN as the literal NaN
    return path


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("runs")
    return (write_run(root, "exploding", "exploding", notes=HOSTILE),
            write_run(root, "stable", "stable"))


@pytest.fixture(scope="module")
def report(two_runs, tmp_path_factory) -> Path:
    return build_report(list(two_runs), tmp_path_factory.mktemp("out") / "report.html")


def _embedded_pngs(page: str) -> dict[str, bytes]:
    found = re.findall(r'<img id="([^"]+)" alt="[^"]+" src="data:image/png;base64,([A-Za-z0-9+/=]+)">', page)
    return {fig_id: base64.b64decode(data) for fig_id, data in found}


def _check_png(data: bytes, min_colours: int = 16) -> Image.Image:
    """A PNG that Pillow can decode and that is not blank (many distinct colours)."""
    assert data[:8] == PNG_SIGNATURE
    image = Image.open(io.BytesIO(data))
    image.load()
    assert image.width > 200 and image.height > 100
    colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) >= min_colours, f"only {len(colours or [])} colours"
    return image


# ------------------------------------------------------------------------------------ loading runs

def test_load_run_splits_steps_events_and_reads_the_files(two_runs):
    run = load_run(two_runs[0])
    assert run.name == "exploding" and run.path == two_runs[0]
    assert len(run.metrics) == LAST_STEP + 1 and all("event" not in r for r in run.metrics)
    assert [e["event"] for e in run.events] == ["monitor_warning", "monitor_action", "nonfinite"]
    assert len(run.probes) == LAST_STEP // PROBE_EVERY
    assert run.config["attention"] == "flash-bf16" and run.attention == "flash-bf16"
    assert run.summary["status"] == "nonfinite" and math.isnan(run.summary["final_loss"])
    assert run.missing == [] and run.skipped == {} and run.problems == []


def test_nonfinite_strings_come_back_as_floats(two_runs):
    steps, loss = metric_series(load_run(two_runs[0]), "loss")
    assert steps[0] == 0 and steps[-1] == LAST_STEP and math.isnan(loss[-1]) and np.isfinite(loss[:-1]).all()
    _, grad = metric_series(load_run(two_runs[0]), "grad_norm")
    assert grad[-1] == math.inf
    val_steps, _ = metric_series(load_run(two_runs[0]), "val_loss")
    assert list(val_steps) == list(range(49, LAST_STEP, 50))
    assert math.isnan(to_float("nan")) and to_float("-inf") == -math.inf and to_float(" INF ") == math.inf
    assert to_float(3) == 3.0 and math.isnan(to_float(None)) and math.isnan(to_float("abc"))
    assert math.isnan(to_float(True))


def test_probe_arrays_have_layer_and_head_axes(two_runs):
    run = load_run(two_runs[0])
    steps, q_full = probe_series(run, "spectral", "q_full")
    assert list(steps) == list(range(0, LAST_STEP, PROBE_EVERY)) and q_full.shape == (40, LAYERS)
    assert q_full[-1, 1] > 10 * q_full[-1, 0]                      # layer 1 grew
    _, frac = probe_series(run, "row", "repeated_max_frac")
    assert frac.shape == (40, LAYERS, HEADS) and frac[-1, 1].mean() > 0.4 > frac[-1, 0].mean()
    deltas = delta_series(run)
    assert list(deltas) == ["0", "1"] and deltas["1"][1].shape == (40,) and deltas["1"][1][-1] < -10
    assert probe_series(run, "spectral", "nope")[0].size == 0


def test_malformed_lines_are_skipped_counted_and_logged(tmp_path, caplog):
    path = tmp_path / "messy"
    path.mkdir()
    (path / "metrics.jsonl").write_text(
        '{"step": 0, "loss": 3.0}\n'
        "not json at all\n"
        '{"step": 1}\n'                        # a step line without a loss
        "[1, 2]\n"                             # not an object
        '{"step": "two", "loss": 1.0}\n'       # not a whole step
        "\n"
        '{"step": 3, "loss": "inf", "event": "nonfinite", "message": "x"}\n'
        '{"step": 3, "event": "monitor_warning", "layer": 0}\n'   # events need no loss
        '{"step": 2, "loss": 2.5}\n')
    (path / "probes.jsonl").write_text('{"step": 0, "spectral": {"q_full": [1.0]}}\n{"no_step": 1}\n')
    (path / "config.json").write_text("{broken")
    with caplog.at_level("WARNING", logger="stableflash.report.runs"):
        run = load_run(path)
    assert [r["step"] for r in run.metrics] == [0, 2] and len(run.events) == 2
    assert run.skipped == {"metrics.jsonl": 4, "probes.jsonl": 1} and len(run.probes) == 1
    assert run.config is None and "config.json is not valid JSON" in run.problems[0]
    assert run.missing == ["summary.json"]
    text = caplog.text
    assert "skipped 4 malformed line(s) (first at line 2)" in text and "metrics.jsonl" in text
    assert "config.json is not valid JSON" in text


def test_steps_logged_twice_are_reported_unless_a_rollback_ran_them_again(tmp_path, caplog):
    """Two runs appending to one folder log steps twice: a one-line problem; the steps a monitor
    rollback runs again (from its checkpoint's step to its own) are no problem."""
    rows = [{"step": s, "loss": 3.0} for s in range(6)]
    rollback = {"step": 5, "loss": 3.0, "event": "monitor_action", "action": "rollback", "to_step": 3}
    cases = {"twice": (rows + rows[:4], "logs 4 step(s) more than once (first: step 0)"),
             "rollback": (rows + [rollback] + rows[3:], None),
             "rollback-then-twice": (rows + [rollback] + rows[3:] + rows[3:], "logs 3 step(s) more than once (first: step 3)")}
    for name, (records, problem) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        caplog.clear()
        with caplog.at_level("WARNING", logger="stableflash.report.runs"):
            run = load_run(tmp_path / name)
        found = [p for p in run.problems if "more than once" in p]
        assert found == ([] if problem is None else [found[0]]) and (problem is None or problem in found[0]), name
        assert (problem is None) == ("more than once" not in caplog.text), name


def test_missing_run_folder_or_metrics_raises_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"run folder .*nowhere does not exist"):
        load_run(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty has no metrics\.jsonl"):
        load_run(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        build_report([tmp_path / "nowhere"], tmp_path / "r.html")
    with pytest.raises(ValueError, match="run_dirs is empty"):
        build_report([], tmp_path / "r.html")


# ----------------------------------------------------------------------------------- the explosion

def test_explosion_step_finds_the_jump_at_300_and_nothing_in_the_stable_run(two_runs):
    # Exactly 300: every loss before it is ≤ 2.5 × 1.015 < 2 × running minimum (≥ 2 × 1.985), the
    # loss at 300 is 10 ≈ 5× the minimum and no later loss comes back below the threshold.
    assert explosion_step(load_run(two_runs[0])) == 300
    assert explosion_step(load_run(two_runs[1])) is None


def _run_with_losses(tmp_path, losses: list) -> object:
    path = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in enumerate(losses)))
    return load_run(path)


def test_explosion_rule_window_factor_and_nonfinite(tmp_path):
    flat = [1.0] * 100
    spike = flat[:40] + [3.0] * 10 + flat[50:]             # back below 2× within 10 steps
    assert explosion_step(_run_with_losses(tmp_path, spike)) is None
    assert explosion_step(_run_with_losses(tmp_path, spike), window=5) == 40
    assert explosion_step(_run_with_losses(tmp_path, spike), factor=4.0) is None
    assert explosion_step(_run_with_losses(tmp_path, flat[:60] + ["nan"] + flat[:10])) == 60
    assert explosion_step(_run_with_losses(tmp_path, flat[:30] + [5.0] * 10)) == 30   # never recovers
    # the loop's stop on a non-finite loss logs a "nonfinite" event, not a loss row, for that step
    stopped = _run_with_losses(tmp_path, flat[:20])
    with open(stopped.path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 20, "event": "nonfinite", "loss": "nan", "grad_norm": "nan"}) + "\n")
    assert explosion_step(load_run(stopped.path)) == 20
    rising = _run_with_losses(tmp_path, flat[:10] + [9.0] * 10)     # an earlier blow-up still comes first
    with open(rising.path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 20, "event": "nonfinite", "loss": "nan", "grad_norm": "nan"}) + "\n")
    assert explosion_step(load_run(rising.path)) == 10
    # logged every 10th step, the minimum (1.0 at step 5) unlogged: 1.9 is not 2x the logged minimum
    # (1.2), but the loop, which saw step 5, stopped the run and named its streak's start
    sparse = tmp_path / "sparse"
    sparse.mkdir()
    rows = [{"step": 0, "loss": 1.2}, {"step": 10, "loss": 1.9}, {"step": 20, "loss": 2.0},
            {"step": 24, "event": "exploded", "loss": 2.0, "since": 8}]
    (sparse / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert explosion_step(load_run(sparse)) == 8
    with pytest.raises(ValueError, match="factor=0"):
        explosion_step(_run_with_losses(tmp_path, flat), factor=0)
    with pytest.raises(ValueError, match="window=-1"):
        explosion_step(_run_with_losses(tmp_path, flat), window=-1)


# ------------------------------------------------------------------------------------------ report

EXPECTED_IDS = ["fig-loss", "fig-grad-norm", "fig-spectral-exploding", "fig-repeated-max-exploding",
                "fig-spectral-stable", "fig-repeated-max-stable", "fig-delta", "fig-monitor"]


def test_json_summary_has_explosion_and_lead_time(report):
    summary = json.loads(report.with_name("report.json").read_text())
    rows = {row["name"]: row for row in summary["runs"]}
    boom, calm = rows["exploding"], rows["stable"]
    assert boom["attention"] == "flash-bf16" and boom["status"] == "nonfinite" and boom["steps"] == 401
    assert boom["final_loss"] == "nan" and 2.0 < boom["best_val_loss"] < 2.3
    assert boom["explosion_step"] == 300 and boom["first_warning_step"] == 250
    assert boom["lead_time"] == 50 and boom["warnings"] == 1
    assert calm["status"] == "finished" and calm["explosion_step"] is None and calm["lead_time"] is None
    assert calm["warnings"] == 0 and calm["first_warning_step"] is None and 1.9 < calm["final_loss"] < 2.2


def test_report_embeds_every_figure_once_as_a_real_png(report):
    page = report.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page.lower()
    assert "http://" not in page and "https://" not in page
    for fig_id in EXPECTED_IDS:
        assert page.count(f'id="{fig_id}"') == 1, fig_id
    images = _embedded_pngs(page)
    assert sorted(images) == sorted(EXPECTED_IDS)
    for fig_id, data in images.items():
        _check_png(data)
        assert (report.parent / "report_files" / f"{fig_id}.png").read_bytes() == data
    assert len(re.findall(r'<img [^>]*alt="[^"]{10,}"', page)) == len(EXPECTED_IDS)
    assert len(re.findall(r"<figcaption>", page)) == len(EXPECTED_IDS)
    assert "could not be drawn" not in page and "No data" not in page
    # the summary table: lead time 50 and the explosion step in the exploding run's row
    row = re.search(r"<tr><td>exploding</td>.*?</tr>", page).group(0)
    assert '<td class="num">300</td>' in row and '<td class="num">50</td>' in row
    # matplotlib can read the file written beside the page too
    from matplotlib.image import imread
    assert imread(report.parent / "report_files" / "fig-loss.png").shape[2] in (3, 4)


def test_report_escapes_strings_from_run_files(report, tmp_path):
    page = report.read_text()
    assert HOSTILE not in page and html_escaped(HOSTILE) in page           # config notes
    run = write_run(tmp_path, "a&b", "stable", attention="flash<script>bad()</script>")
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write(json.dumps({"step": 401, "event": "monitor_warning", "layer": "<b>1</b>", "head": 0}) + "\n")
    page = build_report([run]).read_text()
    assert "<script" not in page.lower() and "<b>1" not in page
    assert "flash&lt;script&gt;bad()&lt;/script&gt;" in page and "a&amp;b" in page
    assert 'id="fig-spectral-a-b"' in page


def html_escaped(text: str) -> str:
    import html
    return html.escape(text)


def test_report_without_optional_files_says_no_data(tmp_path):
    bare = write_run(tmp_path, "bare", "exploding", probes=False, config=False, summary=False)
    out = build_report([bare])
    assert out == bare / "report.html" and (bare / "report.json").is_file()
    page = out.read_text()
    for fig_id in ["fig-loss", "fig-grad-norm", "fig-spectral-bare", "fig-repeated-max-bare", "fig-delta", "fig-monitor"]:
        assert page.count(f'id="{fig_id}"') == 1
    for data in _embedded_pngs(page).values():
        _check_png(data)
    assert page.count("No data: probes.jsonl is missing") == 2 and "No data: no run has delta probes" in page
    assert "no config.json" in page and "no probes.jsonl" in page and "no summary.json" in page
    row = json.loads((bare / "report.json").read_text())["runs"][0]
    assert row["status"] is None and row["attention"] is None and row["steps"] == 401
    assert row["explosion_step"] == 300 and row["lead_time"] == 50
    assert row["missing_files"] == ["probes.jsonl", "config.json", "summary.json"]


def test_plots_draw_no_data_notes_instead_of_raising(tmp_path):
    run = _run_with_losses(tmp_path, [])
    figures = [plots.loss_curves([run]), plots.grad_norm_curves([]), plots.spectral_heatmap(run, "k"),
               plots.repeated_max_vs_loss(run), plots.delta_bias([run]), plots.monitor_timeline([run])]
    for fig in figures:
        texts = [t.get_text() for ax in fig.axes for t in ax.texts]
        assert any(t.startswith("No data") for t in texts), texts
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        _check_png(buffer.getvalue(), min_colours=4)
    with pytest.raises(ValueError, match=r"matrix='x' is invalid; accepted: q, k, v, o"):
        plots.spectral_heatmap(run, "x")


def test_the_monitor_timeline_marks_a_run_stopped_as_exploded(tmp_path):
    run = _run_with_losses(tmp_path, [1.0] * 10 + [3.0] * 6)
    with open(run.path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 15, "event": "exploded", "loss": 3.0, "since": 10}) + "\n")
    fig = plots.monitor_timeline([load_run(run.path)])
    texts = [t.get_text() for t in fig.axes[0].texts]
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "exploded since 10" in texts and "stopped: exploded" in legend, (texts, legend)


def test_loss_figure_scale_and_legend(two_runs, tmp_path):
    runs = [load_run(p) for p in two_runs]
    fig = plots.loss_curves(runs)
    ax = fig.axes[0]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert ax.get_yscale() == "linear"                          # losses span 2..15: under 20×
    wide = _run_with_losses(tmp_path, [100.0 * 0.9 ** s for s in range(60)])   # spans 100 to 0.18
    assert plots.loss_curves([wide]).axes[0].get_yscale() == "log"
    assert "exploding (flash-bf16), explodes at step 300" in labels and "stable (stable-flash)" in labels
    assert {"dots: validation loss", "dashed: explosion step", "crosses: non-finite values"} <= set(labels)
    assert plots.spectral_heatmap(runs[0]).axes[0].get_xlabel() == "probe step"


CHROMIUM = Path("/usr/bin/chromium")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium is not installed (apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(report, tmp_path):
    shot = tmp_path / "shot.png"
    subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1400,3000",
                    report.resolve().as_uri()], check=True, capture_output=True, timeout=90)
    image = _check_png(shot.read_bytes(), min_colours=64)
    assert image.size == (1400, 3000)
    # the page is not just white: a good share of the screenshot is drawn on
    pixels = np.asarray(image.convert("L"))
    assert (pixels < 200).mean() > 0.01


@pytest.mark.slow
def test_runs_of_several_seeds_get_distinct_names_and_figures(tmp_path):
    """A reproduction's runs are all named baseline/stabilized/control, one per seed folder: the
    report names them with their seed folder and draws one figure per run."""
    dirs = [write_run(tmp_path / f"seed{s}", role, "exploding" if role == "baseline" else "stable",
                      attention="triton policy=paper acc=e8m5 row_sum=e8m5 out=e8m5"
                      + (" stabilize=tie-shift" if role == "stabilized" else ""))
            for s in (0, 1) for role in ("baseline", "stabilized")]
    out = build_report(dirs, tmp_path / "out" / "report.html")
    names = [r["name"] for r in json.loads(out.with_suffix(".json").read_text())["runs"]]
    assert names == ["seed0/baseline", "seed0/stabilized", "seed1/baseline", "seed1/stabilized"]
    figures = sorted(p.name for p in (out.parent / "report_files").glob("fig-spectral-*.png"))
    assert figures == [f"fig-spectral-seed{s}-{r}.png" for s in (0, 1) for r in ("baseline", "stabilized")]
    # the legend keeps the end of a long attention spec, where the runs differ (stabilize=tie-shift)
    labels = [t.get_text() for t in plots.loss_curves([load_run(d) for d in dirs]).legends[0].get_texts()]
    assert any(label.startswith("stabilized (triton") and "stabilize=tie-shift)" in label for label in labels)


def test_unique_names_are_kept_and_heatmap_numbers_stay_short(two_runs):
    from stableflash.report.html import distinct_names
    runs = [load_run(p) for p in two_runs]
    assert [r.name for r in distinct_names(runs)] == ["exploding", "stable"]
    assert [plots._compact(v) for v in (8.17, 328, 1370, 5060, 12345, 2.3e5)] == \
        ["8.17", "328", "1.4k", "5.1k", "12k", "2e5"]


def test_many_long_legend_entries_stay_inside_the_figure(tmp_path):
    """Nine runs with long labels: the legend below the plot fits the figure's width."""
    runs = []
    for s in range(9):
        path = write_run(tmp_path, f"run-with-a-long-name-{s}", "stable",
                         attention=f"triton policy=paper acc=e8m5 row_sum=e8m5 out=e8m5 stabilize=tie-shift beta={s + 2}")
        runs.append(load_run(path))
    fig = plots.loss_curves(runs)
    fig.canvas.draw()
    legend_box = fig.legends[0].get_window_extent()
    assert legend_box.x0 >= 0 and legend_box.x1 <= fig.bbox.width, (legend_box, fig.bbox.width)


def test_event_labels_leave_out_a_layer_or_head_the_event_does_not_name():
    """The loss warning names no layer and the W_Q one no head (both logged as null)."""
    loss = {"event": "monitor_warning", "layer": None, "head": None, "indicator": "loss"}
    spectral = {"event": "monitor_warning", "layer": 0, "head": None, "indicator": "spectral_q"}
    logit = {"event": "monitor_warning", "layer": 2, "head": 1, "indicator": "max_logit"}
    assert [plots._event_text(e) for e in (loss, spectral, logit)] == ["loss", "L0 spectral_q", "L2 H1 max_logit"]
    assert plots._event_text({"event": "exploded", "since": 13}) == "exploded since 13"
