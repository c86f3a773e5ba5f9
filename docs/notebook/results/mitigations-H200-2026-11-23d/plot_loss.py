# loss curves, seed 1: earlier baselines against stabilize=True (guarded δ, standard row max)
import sys
import matplotlib; matplotlib.use("Agg")
import matplotlib.pyplot as plt
from stableflash.report import load_run, loss_series
runs = [("fp8 P̄, bf16 O: baseline", "/tmp/prev23b/sess-d/fp8-pv/seed1/baseline", "C0", ":"),
        ("fp8 P̄, bf16 O: stabilize=True", "/tmp/res/sess-h/g-fp8-pv/seed1/baseline", "C0", "-"),
        ("FP8 product: baseline", "/tmp/prev23c/sess-e/fp8-real/seed1/baseline", "C1", ":"),
        ("FP8 product: stabilize=True", "/tmp/res/sess-h/g-fp8-real/seed1/baseline", "C1", "-"),
        ("Llama fp8: baseline", "/tmp/prev23c/sess-f/a-llama-fp8/seed1/baseline", "C2", ":"),
        ("Llama fp8: stabilize=True", "/tmp/res/sess-h/g-llama-fp8/seed1/baseline", "C2", "-"),
        ("fa2-e8m4: δ from O as computed, no rule", "/tmp/res/sess-g/m-o32c-norule/seed1/baseline", "C3", "-"),
        ("e5m2: δ from 16-bit product, no rule", "/tmp/res/sess-g/m-o16-norule-e5m2/seed1/baseline", "C4", "-")]
fig, ax = plt.subplots(figsize=(9, 5))
for label, path, color, style in runs:
    ax.plot(*loss_series(load_run(path)), style, color=color, label=label, lw=1)
ax.set_yscale("log"); ax.set_xlabel("step"); ax.set_ylabel("training loss"); ax.set_ylim(0.25, 12)
ax.set_title("seed 1: baselines (dotted) and the guarded δ without our rule (solid), H200")
ax.legend(fontsize=8); fig.tight_layout(); fig.savefig(sys.argv[1], dpi=110)
