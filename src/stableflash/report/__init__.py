"""Reports of training runs: load run folders, draw the figures, write a self-contained HTML page.

``build_report(run_dirs, out)`` is the entry point (``stableflash report``); ``load_run`` and the
array helpers read a run folder; :mod:`stableflash.report.plots` draws each figure on its own.
Drawing needs matplotlib (the ``plot`` extra); loading runs does not.
"""
from .html import build_report, run_summary
from .runs import (Run, delta_series, events_of, explosion_step, first_event_step, load_run, loss_series,
                   metric_series, probe_series, to_float)

__all__ = ["Run", "build_report", "delta_series", "events_of", "explosion_step", "first_event_step",
           "load_run", "loss_series", "metric_series", "probe_series", "run_summary", "to_float"]
