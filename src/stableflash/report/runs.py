"""Loading run folders (``metrics.jsonl``, ``probes.jsonl``, ``config.json``, ``summary.json``).

A run folder is read defensively: only ``metrics.jsonl`` is required; malformed lines are skipped,
counted and logged; the optional files may be missing or unreadable. The helpers turn the records
into numpy arrays, reading the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (how the metrics writer
stores non-finite numbers) back as floats.
"""
from __future__ import annotations

import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stableflash.train.stopping import EXPLOSION_FACTOR

log = logging.getLogger(__name__)

_NONFINITE = {"nan": math.nan, "+nan": math.nan, "-nan": math.nan, "inf": math.inf, "+inf": math.inf,
              "infinity": math.inf, "+infinity": math.inf, "-inf": -math.inf, "-infinity": -math.inf}

@dataclass
class Run:
    """One training run folder, as read by :func:`load_run`.

    ``metrics`` holds the step records (lines without ``"event"``), ``events`` the event records,
    both sorted by step. ``config`` and ``summary`` are ``None`` when their file is missing or
    unreadable. ``skipped`` counts malformed lines per file; ``missing`` names the optional files
    that are absent; ``problems`` describes anything else that was ignored.
    """

    name: str
    path: Path
    metrics: list[dict]
    events: list[dict]
    probes: list[dict] = field(default_factory=list)
    config: dict | None = None
    summary: dict | None = None
    skipped: dict[str, int] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def attention(self) -> str | None:
        """The attention spec from config.json (or summary.json), as text; ``None`` if neither says."""
        for source in (self.config, self.summary):
            if isinstance(source, dict) and source.get("attention") not in (None, ""):
                return str(source["attention"])
        return None


def to_float(value: Any) -> float:
    """A JSON value as a float: numbers as they are, ``"nan"``/``"inf"``/``"-inf"`` strings as the
    non-finite floats they stand for, anything else (missing, text, bools) as NaN."""
    if isinstance(value, bool) or value is None:
        return math.nan
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _NONFINITE:
            return _NONFINITE[text]
        try:
            return float(text)
        except ValueError:
            return math.nan
    return math.nan


def _as_step(value: Any) -> int | None:
    """An integer step, or None when ``value`` is not a whole, finite, non-bool number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and (not math.isfinite(value) or not value.is_integer()):
        return None
    return int(value)


def _read_jsonl(path: Path, required: tuple[str, ...]) -> tuple[list[dict], int]:
    """The JSON objects of a JSON-lines file that have a whole-number ``step`` and, unless they are
    events (have ``"event"``), the ``required`` keys; also the number of non-blank lines that were
    skipped as malformed."""
    records, skipped, first_bad = [], 0, None
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            step = _as_step(record.get("step")) if isinstance(record, dict) else None
            if step is None or ("event" not in record and any(key not in record for key in required)):
                skipped += 1
                first_bad = first_bad or number
                continue
            record["step"] = step
            records.append(record)
    if skipped:
        need = " and ".join(("a whole-number step",) + required)
        log.warning("%s: skipped %d malformed line(s) (first at line %d); each line must be a JSON "
                    "object with %s%s", path, skipped, first_bad, need, " (events: a step)" if required else "")
    records.sort(key=lambda r: r["step"])       # stable: equal steps keep their file order
    return records, skipped


def _upgrade_stored(run: Run) -> None:
    """A run folder written in the earlier attention-spec grammar (no ``config_version`` in its
    config.json or summary.json) with its specs rewritten in the current one, meaning kept."""
    from stableflash.model.spec import upgrade_stored_spec
    from stableflash.train.config import upgrade_stored
    legacy = not any(isinstance(d, dict) and "config_version" in d for d in (run.config, run.summary))
    if not legacy:
        return
    if isinstance(run.config, dict):
        run.config = upgrade_stored(run.config)
    if isinstance(run.summary, dict):
        run.summary = {k: upgrade_stored_spec(v) if k in ("attention", "final_attention") else v
                       for k, v in run.summary.items()}


def _repeated_steps(run: Run) -> list[int]:
    """Steps with more step records than one plus the monitor rollbacks that ran them again (a
    rollback to the checkpoint of step c at step s runs steps c..s once more)."""
    allowed: Counter = Counter()
    for event in run.events:
        to_step = _as_step(event.get("to_step"))
        if event.get("action") == "rollback" and to_step is not None:
            allowed.update(range(to_step, event["step"] + 1))
    counts = Counter(record["step"] for record in run.metrics)
    return sorted(step for step, n in counts.items() if n > 1 + allowed[step])


def _read_json(path: Path, run: Run) -> dict | None:
    if not path.is_file():
        run.missing.append(path.name)
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as exc:
        run.problems.append(f"{path.name} is not valid JSON ({exc}); ignored")
        log.warning("%s is not valid JSON (%s); ignored", path, exc)
        return None
    if not isinstance(data, dict):
        run.problems.append(f"{path.name} holds a {type(data).__name__}, not an object; ignored")
        log.warning("%s holds a %s, expected a JSON object; ignored", path, type(data).__name__)
        return None
    return data


def load_run(path: Path | str) -> Run:
    """Read a run folder. Raises FileNotFoundError if the folder or its ``metrics.jsonl`` is missing."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"run folder {path} does not exist (or is not a folder); "
                                "expected a training run folder holding metrics.jsonl")
    metrics_path = path / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"run folder {path} has no metrics.jsonl; expected the file "
                                "written by `stableflash train` (one JSON object per line)")
    run = Run(name=path.resolve().name or str(path), path=path, metrics=[], events=[])
    records, skipped = _read_jsonl(metrics_path, required=("loss",))
    if skipped:
        run.skipped["metrics.jsonl"] = skipped
    for record in records:
        (run.events if "event" in record else run.metrics).append(record)
    repeated = _repeated_steps(run)
    if repeated:
        run.problems.append(f"metrics.jsonl logs {len(repeated)} step(s) more than once (first: step {repeated[0]}), "
                            "which no monitor rollback explains; two runs may have written into this folder")
        log.warning("%s: %s", metrics_path, run.problems[-1])

    probes_path = path / "probes.jsonl"
    if probes_path.is_file():
        run.probes, skipped = _read_jsonl(probes_path, required=())
        if skipped:
            run.skipped["probes.jsonl"] = skipped
    else:
        run.missing.append("probes.jsonl")
    run.config = _read_json(path / "config.json", run)
    run.summary = _read_json(path / "summary.json", run)
    _upgrade_stored(run)
    return run


# ----------------------------------------------------------------------------------------- arrays

def metric_series(run: Run, key: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps (int64) and values (float64) of the step records that carry ``key``, sorted by step."""
    rows = [(r["step"], to_float(r[key])) for r in run.metrics if key in r]
    if not rows:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    steps, values = zip(*rows)
    return np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64)


def loss_series(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """Steps and training losses (non-finite losses as NaN/±inf)."""
    return metric_series(run, "loss")


def _nested_array(value: Any) -> np.ndarray | None:
    """A (possibly nested) list of numbers as a float array; ragged rows are padded with NaN."""
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return np.asarray(to_float(value))
    if not isinstance(value, list):
        return None
    if all(not isinstance(v, list) for v in value):
        return np.asarray([to_float(v) for v in value], dtype=np.float64)
    rows = [_nested_array(v) for v in value]
    if any(r is None for r in rows):
        return None
    return _stack(rows)


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    """Stack arrays of possibly different shapes (same rank), padding with NaN."""
    ndim = max(a.ndim for a in arrays)
    arrays = [a.reshape(a.shape + (1,) * (ndim - a.ndim)) for a in arrays]
    shape = tuple(max(a.shape[d] for a in arrays) for d in range(ndim))
    out = np.full((len(arrays),) + shape, np.nan)
    for i, a in enumerate(arrays):
        out[(i,) + tuple(slice(0, n) for n in a.shape)] = a
    return out


def probe_series(run: Run, section: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """Probe steps (P,) and values (P, ...) of ``probes[i][section][key]``.

    E.g. ``("spectral", "q_full")`` gives (P, layers), ``("row", "repeated_max_frac")`` gives
    (P, layers, heads). Records without the field are left out; ragged shapes are NaN-padded.
    """
    steps, arrays = [], []
    for record in run.probes:
        block = record.get(section)
        if not isinstance(block, dict):
            continue
        array = _nested_array(block.get(key))
        if array is None or array.size == 0:
            continue
        steps.append(record["step"])
        arrays.append(array)
    if not arrays:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 0))
    return np.asarray(steps, dtype=np.int64), _stack(arrays)


def _layer_order(name: str) -> tuple[int, str]:
    try:
        return int(name), ""
    except ValueError:
        return 1 << 30, name


def delta_series(run: Run, key: str = "running_sum") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per probed layer (sorted numerically): probe steps and ``probes[i]["delta"][layer][key]``."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in run.probes:
        block = record.get("delta")
        if not isinstance(block, dict):
            continue
        for layer, stats in block.items():
            if isinstance(stats, dict) and key in stats:
                series.setdefault(str(layer), []).append((record["step"], to_float(stats[key])))
    return {layer: (np.asarray([s for s, _ in rows], dtype=np.int64), np.asarray([v for _, v in rows]))
            for layer, rows in sorted(series.items(), key=lambda item: _layer_order(item[0]))}


def events_of(run: Run, *kinds: str) -> list[dict]:
    """The run's events whose ``"event"`` is one of ``kinds`` (all events if none given)."""
    return [e for e in run.events if not kinds or e.get("event") in kinds]


def first_event_step(run: Run, kind: str) -> int | None:
    """Step of the first ``kind`` event, or None."""
    steps = [e["step"] for e in events_of(run, kind)]
    return min(steps) if steps else None


# -------------------------------------------------------------------------------------- explosion

def explosion_step(run: Run, factor: float = EXPLOSION_FACTOR, window: int = 50) -> int | None:
    """First step where the training loss blows up, or None.

    A step counts when its loss is non-finite (also a ``nonfinite`` event: the loop stops there
    without logging the step's loss), or when it exceeds ``factor`` × the running minimum
    of the finite losses so far and no logged loss in the following ``window`` steps comes back
    below that threshold. A rise near the end of the record counts when the remaining logged
    steps all stay above it (nothing shows a recovery). A run that ``stop_after_explosion`` stopped
    and whose logged rows show no explosion (with ``log_every`` > 1 their running minimum can sit
    above the true one) exploded at its ``exploded`` event's streak start.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ValueError(f"factor={factor!r} is invalid; accepted: a positive number (e.g. 2.0)")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window={window!r} is invalid; accepted: a non-negative whole number of steps")
    # a run stopped on a non-finite loss or gradient norm logs that step as an event, not a loss row
    stopped = [int(e["step"]) for e in events_of(run, "nonfinite")]
    # stop_after_explosion's event names the first step of its streak, judged on every step's loss:
    # the answer when the logged rows (every log_every-th step) do not show the explosion themselves
    streaks = [int(e["since"]) for e in events_of(run, "exploded") if isinstance(e.get("since"), int)]
    steps, loss = loss_series(run)
    running_min = math.inf
    for i in range(len(steps)):
        value = loss[i]
        if not math.isfinite(value):
            return min([int(steps[i]), *stopped])
        running_min = min(running_min, value)
        threshold = factor * running_min
        if value <= threshold:
            continue
        end = np.searchsorted(steps, steps[i] + window, side="right")
        ahead = loss[i + 1:end]
        if not np.any(np.isfinite(ahead) & (ahead < threshold)):
            return min([int(steps[i]), *stopped])
    return min(stopped) if stopped else min(streaks, default=None)
