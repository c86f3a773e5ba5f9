# loss curves on kernel-fa2-e8m4, one seed: the baseline (2026-11-22), the guard's dO·(O+R) without a
# rule (2026-11-23f), and this folder's mitigation rows. Unpack first:
#   mkdir -p /tmp/g/runs /tmp/pb /tmp/x/runs
#   tar xJf docs/results/mitigations-H200-2026-11-23g/runs.tar.xz -C /tmp/g/runs
#   tar xJf docs/results/mitigations-H200-2026-11-22/runs.tar.xz -C /tmp/pb sess/fa2-e8m4
#   tar xJf docs/results/mitigations-H200-2026-11-23f/runs.tar.xz -C /tmp/x/runs ./r-oplusr-e8m4
# then: python docs/results/mitigations-H200-2026-11-23g/plot_loss.py SEED OUT.png
import sys
import matplotlib; matplotlib.use("Agg")
import matplotlib.pyplot as plt
from stableflash.report import load_run, loss_series
seed = sys.argv[1]
runs = [("baseline (2026-11-22)", f"/tmp/pb/sess/fa2-e8m4/seed{seed}/baseline", "k", ":"),
        ("paper's rule, β = 2 (non-finite)", f"/tmp/g/runs/x-e8m4-paper2/seed{seed}/baseline", "C3", "-"),
        ("stochastic rounding of the O store", f"/tmp/g/runs/x-e8m4-sr/seed{seed}/baseline", "C1", "-"),
        ("gated attention", f"/tmp/g/runs/x-e8m4-gate/seed{seed}/baseline", "C4", "-"),
        ("QK-norm", f"/tmp/g/runs/x-e8m4-qknorm/seed{seed}/baseline", "C2", "-"),
        ("soft-capping at 30", f"/tmp/g/runs/x-e8m4-softcap/seed{seed}/baseline", "C9", "-"),
        ("stabilize=True: δ from O + R, no rule (2026-11-23f)", f"/tmp/x/runs/r-oplusr-e8m4/seed{seed}/baseline", "C0", "-")]
fig, ax = plt.subplots(figsize=(9, 5))
for label, path, color, style in runs:
    steps, losses = loss_series(load_run(path))
    ax.plot(steps, losses, style, color=color, label=label, lw=1)
    if steps[-1] < 4900:                       # a run that stopped (non-finite, or 400 steps into an explosion)
        ax.plot(steps[-1], losses[-1], "x", color=color, ms=9, mew=2)
ax.set_yscale("log"); ax.set_xlabel("step"); ax.set_ylabel("training loss"); ax.set_ylim(0.25, 12)
ax.set_xlim(0, 5000)
ax.set_title(f"kernel-fa2-e8m4 (O stored in e8m4), seed {seed}: every mitigation (x: run stopped), H200")
ax.legend(fontsize=8); fig.tight_layout(); fig.savefig(sys.argv[2], dpi=110)
