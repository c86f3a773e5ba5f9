"""Rewrite a results folder's ``runs.tar.xz`` into its compact form: the same member names (so the
``tar xJf runs.tar.xz ... MEMBER`` commands of the READMEs still work) and real run folders that
``stableflash.report.load_run`` and the benchmark scripts read unchanged, holding only what the
tables and figures need.

    python docs/notebook/results/compact_runs.py FULL.tar.xz OUT.tar.xz

What each run folder keeps:

* ``config.json``, ``summary.json``, ``repro.json``, ``report.json``, ``ladder.json`` and logs
  (``*.log``) as they were;
* ``metrics.jsonl``: every event line (monitor warnings and actions, ``exploded``, ``nonfinite``) as
  it was, and the step rows with ``step``, ``loss``, ``grad_norm`` and ``val_loss`` (``lr``, ``ms``,
  ``tokens_per_s`` and ``mfu`` dropped) that are:
  every 50th step, the first and the last row, every row of the last 100 logged steps
  (``benchmarks/runs/run_outcomes.py``'s final loss and step count), every row in the 100 steps up to
  each step of ``LOSS_AT_STEPS`` (``benchmarks/runs/loss_at.py STEP``), every row with a ``val_loss``
  or a non-finite loss, every row that sets a new running minimum of the loss (the lowest loss and
  ``report.explosion_step``'s threshold), every row from 200 steps before the explosion step to
  200 after it, and every row above ``EXPLOSION_FACTOR`` × the running minimum up to the explosion
  step together with the first row after it that comes back below (so ``explosion_step`` decides
  the same way on the compact rows);
* ``probes.jsonl``: every record, with ``step``, ``n_seq``, ``seq_len``, ``delta``,
  ``spectral.q_full`` (the last record also ``spectral.q``, per head: the ladder reads the failing
  heads off it) and ``row`` ``repeated_max_frac``, ``sink_frac``, ``sink_repeated_frac`` as
  recorded, and ``row.max_logit`` reduced to each layer's largest value at its head (the other
  heads null) written as its shortest float32 decimal (the probes compute it in float32: the same
  float32 value, on the same side of every float32-representable threshold), which is what
  ``diagnostics.monitor.largest_logits`` reads; the per-head ``k``/``v``/``o`` and whole-matrix
  ``k_full``/``v_full``/``o_full`` norms, ``pbar_one_count`` and ``probe_ms`` dropped.

Dropped: ``report.html`` and the report's PNGs (``stableflash report`` on the compact runs draws
them again). Every other kept number is copied as recorded.
"""
from __future__ import annotations

import io
import json
import math
import sys
import tarfile
from pathlib import PurePosixPath

import numpy as np

from stableflash.train.stopping import EXPLOSION_FACTOR

EVERY = 50
LOSS_AT_STEPS = (800, 1000, 1200, 1400, 1600, 2200, 2500, 2600, 4000, 5000, 6000)   # the docs' loss_at.py STEPs
WINDOW = 50                # report.runs.explosion_step's default look-ahead
AROUND_EXPLOSION = 200
METRIC_KEYS = ("step", "loss", "grad_norm", "val_loss")
SPECTRAL_KEYS = ("q_full",)
ROW_KEYS = ("repeated_max_frac", "max_logit", "sink_frac", "sink_repeated_frac")
PROBE_KEYS = ("step", "n_seq", "seq_len", "spectral", "row", "delta")
DROP_SUFFIXES = (".html", ".png")


def _loss(value) -> float:
    if isinstance(value, bool) or value is None:
        return math.nan
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(str(value).strip().lower().replace("infinity", "inf"))
    except ValueError:
        return math.nan


def compact_metrics(text: str) -> str:
    """The kept lines of a metrics.jsonl (see the module docstring), in file order."""
    lines = text.splitlines()
    parsed = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        parsed.append(record if isinstance(record, dict) else None)
    rows = [i for i, r in enumerate(parsed)
            if r is not None and "event" not in r and isinstance(r.get("step"), int) and "loss" in r]
    keep = set()
    if rows:
        keep.update((rows[0], rows[-1]))
        last = max(parsed[i]["step"] for i in rows)
        # the same scan as report.runs.explosion_step, over the rows sorted by step
        order = sorted(rows, key=lambda i: parsed[i]["step"])
        steps = [parsed[i]["step"] for i in order]
        loss = [_loss(parsed[i]["loss"]) for i in order]
        running, boom = math.inf, None
        for k, i in enumerate(order):
            value = loss[k]
            if not math.isfinite(value):
                keep.add(i)
                boom = steps[k] if boom is None else boom
                continue
            if boom is not None:
                continue
            if value < running:
                keep.add(i)                               # a new running minimum
            running = min(running, value)
            if value > EXPLOSION_FACTOR * running:
                keep.add(i)
                ahead = [j for j in range(k + 1, len(order)) if steps[j] <= steps[k] + WINDOW]
                back = next((j for j in ahead if math.isfinite(loss[j]) and loss[j] < EXPLOSION_FACTOR * running), None)
                if back is None:
                    boom = steps[k]
                else:
                    keep.add(order[back])
        for k, i in enumerate(order):
            step, record = steps[k], parsed[i]
            if (step % EVERY == 0 or step > last - 100 or "val_loss" in record
                    or any(s - 100 < step <= s for s in LOSS_AT_STEPS)
                    or (boom is not None and abs(step - boom) <= AROUND_EXPLOSION)):
                keep.add(i)
        # the running minimum after the explosion too (run_outcomes.py's lowest loss)
        low = min(range(len(order)), key=lambda k: loss[k] if math.isfinite(loss[k]) else math.inf)
        keep.add(order[low])
    out = []
    for i, (line, record) in enumerate(zip(lines, parsed)):
        if record is None:
            if line.strip():
                out.append(line)                          # malformed lines stay for the reader to skip
        elif "event" in record or not (isinstance(record.get("step"), int) and "loss" in record):
            out.append(line)
        elif i in keep:
            out.append(json.dumps({k: record[k] for k in METRIC_KEYS if k in record}))
    return "".join(line + "\n" for line in out)


def _layer_maxima(rows):
    """``row.max_logit`` (layers × heads) with only each layer's largest finite value kept, at its
    head; the other heads' values as null. ``diagnostics.monitor.largest_logits`` (the monitor's
    largest-logit indicator, ``benchmarks/runs/max_logit.py``) reads the same (layer, value, head)."""
    if not isinstance(rows, list) or not all(isinstance(heads, list) for heads in rows):
        return rows
    out = []
    for heads in rows:
        finite = [h for h, v in enumerate(heads) if isinstance(v, (int, float)) and not isinstance(v, bool)
                  and math.isfinite(v)]
        best = max(finite, key=lambda h: heads[h], default=None)   # the first of equal maxima, as max() picks
        out.append([_float32_text(v) if h == best else None for h, v in enumerate(heads)])
    return out


def _float32_text(value):
    """A float32 value (as the probes' logits are) as its shortest float32 decimal; other values as
    they are. Reading it back and converting to float32 gives the same value, and it lies on the
    same side of every float32-representable number (87, 100, 110.5, ...) as the original."""
    if isinstance(value, list):
        return [_float32_text(v) for v in value]
    if isinstance(value, float) and math.isfinite(value) and float(np.float32(value)) == value:
        return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))
    return value


def compact_probes(text: str) -> str:
    lines = text.splitlines()
    last_spectral = max((i for i, line in enumerate(lines) if '"spectral"' in line), default=None)
    out = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if line.strip():
                out.append(line)
            continue
        if not isinstance(record, dict):
            out.append(line)
            continue
        slim = {k: record[k] for k in PROBE_KEYS if k in record}
        if isinstance(slim.get("spectral"), dict):
            # the per-head W_Q norms only on the last record: stableflash.repro.ladder reads the
            # failing heads off it when a compact baseline is copied in as a ladder's baseline
            keys = SPECTRAL_KEYS + (("q",) if i == last_spectral else ())
            slim["spectral"] = {k: v for k, v in slim["spectral"].items() if k in keys}
        if isinstance(slim.get("row"), dict):
            slim["row"] = {k: v for k, v in slim["row"].items() if k in ROW_KEYS}
            if "max_logit" in slim["row"]:
                slim["row"]["max_logit"] = _layer_maxima(slim["row"]["max_logit"])
        out.append(json.dumps(slim))
    return "".join(line + "\n" for line in out)


def compact_archive(src: str, dst: str) -> None:
    with tarfile.open(src, "r:xz") as full, tarfile.open(dst, "w:xz", preset=9) as out:
        for member in full.getmembers():
            name = PurePosixPath(member.name)
            if member.isdir():
                if name.name == "report_files":
                    continue
                out.addfile(member)
                continue
            if not member.isfile() or name.suffix in DROP_SUFFIXES or "report_files" in name.parts:
                continue
            data = full.extractfile(member).read()
            if name.name == "metrics.jsonl":
                data = compact_metrics(data.decode("utf-8", errors="replace")).encode()
            elif name.name == "probes.jsonl":
                data = compact_probes(data.decode("utf-8", errors="replace")).encode()
            info = tarfile.TarInfo(member.name)
            info.size, info.mtime, info.mode = len(data), member.mtime, member.mode
            info.uname, info.gname, info.uid, info.gid = "", "", 0, 0
            out.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    compact_archive(sys.argv[1], sys.argv[2])
