# cpu-fp8, seed 0: the baseline, the stabilized run, the switch with the default indicators (all
# 2026-11-23e) and the switch warned by the largest logit (this folder). Unpack first:
#   mkdir -p /tmp/cpuf /tmp/cpug && tar xJf docs/results/cpu-fp8-2026-11-23e/runs.tar.xz -C /tmp/cpuf
#   tar xJf docs/results/cpu-fp8-2026-11-23g/runs.tar.xz -C /tmp/cpug
# then: python docs/results/cpu-fp8-2026-11-23g/plot_loss.py OUT.png   (dotted lines: the switches)
import sys

import matplotlib; matplotlib.use("Agg")
import matplotlib.pyplot as plt

from stableflash.report import events_of, load_run, loss_series

runs = [("baseline (P̄, O in e5m2)", "/tmp/cpuf/e5m2-s0", "C3", "-"),
        ("stabilized (stabilize=True)", "/tmp/cpuf/rp0/seed0/stabilized", "C0", "-"),
        ("switch to delta=auto, default indicators", "/tmp/cpuf/sw0/seed0/baseline", "C1", "--"),
        ("switch to delta=auto, warned by the largest logit (> 200)", "/tmp/cpug/cpusw/seed0/baseline", "C2", "-")]
fig, ax = plt.subplots(figsize=(9, 5))
for label, path, color, style in runs:
    run = load_run(path)
    ax.plot(*loss_series(run), style, color=color, label=label, lw=1)
    for e in events_of(run, "monitor_action"):
        ax.axvline(e["step"], color=color, lw=0.8, ls=":")
ax.set_yscale("log"); ax.set_xlabel("step"); ax.set_ylabel("training loss"); ax.set_ylim(0.8, 6); ax.set_xlim(0, 3600)
ax.set_title("cpu-fp8, seed 0: the monitor's switch, warned late (W_Q) and early (largest logit)")
ax.legend(fontsize=8); fig.tight_layout(); fig.savefig(sys.argv[1], dpi=110)
