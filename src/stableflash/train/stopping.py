"""Stopping a run whose loss has exploded, so that runs sharing a GPU get it back.

A step is *above* when its loss exceeds ``factor`` × the running minimum of the finite losses so
far; a run stops once the steps from the first of an unbroken streak of such steps to the current
one number ``after``, and its ``exploded`` event names the streak's first step. A stopped run
still counts as exploded: ``report.runs.explosion_step`` (same factor, a window shorter than
``after``) finds the explosion in the logged rows — with ``log_every`` > 1 a few steps after the
streak's start, as for a run that went on — or else takes the event's streak start.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

EXPLOSION_FACTOR = 2.0              # loss above this × its running minimum: exploded (here and in reports)


@dataclass
class ExplosionStop:
    after: int                      # steps above the threshold in a row that stop the run (0: never)
    factor: float = EXPLOSION_FACTOR
    running_min: float = math.inf
    above_since: int | None = None  # first step of the current streak above the threshold

    def observe(self, step: int, loss: float) -> bool:
        """Record one step's loss; True when the run should stop now."""
        if not math.isfinite(loss):
            return False            # non-finite losses are stop_on_nonfinite's business
        if loss > self.factor * self.running_min:
            if self.above_since is None:
                self.above_since = step
        else:
            self.above_since = None
        self.running_min = min(self.running_min, loss)
        return bool(self.after) and self.above_since is not None and step - self.above_since + 1 >= self.after

    def replay(self, rows) -> None:
        """Rebuild the state from a resumed run's logged rows (dicts with "step" and "loss")."""
        for row in rows:
            if "event" not in row and isinstance(row.get("loss"), (int, float)):
                self.observe(int(row["step"]), float(row["loss"]))
