# loss curves of the cpu-fp8 runs, seed 0 (run folders as unpacked from runs.tar.xz under /tmp/cpuf)
# usage: python docs/notebook/results/cpu-fp8-2026-11-23e/plot_loss.py OUT.png
import sys

import matplotlib; matplotlib.use("Agg")
import matplotlib.pyplot as plt

from stableflash.report import events_of, load_run, loss_series

runs = [("baseline (P̄, O in e5m2)", "/tmp/cpuf/e5m2-s0", "C3", "-"),
        ("stabilized (stabilize=True: δ from the 16-bit product's O)", "/tmp/cpuf/rp0/seed0/stabilized", "C0", "-"),
        ("control (P̄, Ō, ℓ, O in fp32)", "/tmp/cpuf/rp0/seed0/control", "C2", "-"),
        ("baseline with the monitor's switch to delta=auto", "/tmp/cpuf/sw0/seed0/baseline", "C1", "--")]
fig, ax = plt.subplots(figsize=(9, 5))
for label, path, color, style in runs:
    run = load_run(path)
    ax.plot(*loss_series(run), style, color=color, label=label, lw=1)
    for e in events_of(run, "monitor_action"):
        ax.axvline(e["step"], color=color, lw=0.6, ls=":")
ax.set_yscale("log"); ax.set_xlabel("step"); ax.set_ylabel("training loss"); ax.set_ylim(0.8, 6)
ax.set_title("cpu-fp8, seed 0: 4-layer byte-level GPT on 2 CPU cores, FP8 e5m2 attention rounding")
ax.legend(fontsize=8); fig.tight_layout(); fig.savefig(sys.argv[1], dpi=110)
