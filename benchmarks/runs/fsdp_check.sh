#!/usr/bin/env bash
# One GPU against two under DDP and under FSDP2 (parallel=fsdp), with the same global batch and data
# order: loss curves step by step (benchmarks/runs/compare_runs.py) and tokens/s (the scaling).
#   1. GPT-2 small, the paper recipe's shape (16 micro-batches of 32 x 1024 per step), compiled:
#      1 GPU, 2 GPUs DDP, 2 GPUs FSDP2 (its sharded checkpoint of the last step written by both ranks);
#   2. GPT-2 medium, 8 micro-batches of 32 x 1024 per step, compiled: 1 GPU, 2 GPUs FSDP2.
# Needs two GPUs (the device tool's nvidia-h200-x2); about 8 minutes there. PARTS="small" or "medium"
# runs one part; GPT2_STEPS / MEDIUM_STEPS set the steps. Without a GPU (or CPU=1) it runs the same
# sequence on the CPU with the tiny preset over gloo, to check the script itself.
# Usage (repository root): bash benchmarks/runs/fsdp_check.sh   -> $OUT/fsdp_check.json and a table, last
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
PARTS=${PARTS:-small medium}
if [[ "${CPU:-0}" != 1 ]] && nvidia-smi > /dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/env.txt"
  SMALL="--preset gpt2-small-paper --set data=embedded --set max_iters=${GPT2_STEPS:-20}"
  MEDIUM="--preset gpt2-medium-paper --set data=embedded --set max_iters=${MEDIUM_STEPS:-12} --set grad_accum=8"
  WARM=5
else
  echo "no GPU (or CPU=1): the CPU check of this script, tiny preset over gloo" | tee "$OUT/env.txt"
  SMALL="--preset tiny --set device=cpu --set max_iters=${GPT2_STEPS:-8} --set grad_accum=4"
  MEDIUM="--preset tiny --set device=cpu --set max_iters=${MEDIUM_STEPS:-6} --set grad_accum=2 --set n_layer=4"
  WARM=2
fi
COMMON="--set probe_every=0 --set log_every=1 --set eval_every=100000 --set ckpt_every=100000"
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc_per_node=2 -m stableflash.cli train"

run() {  # NAME LAUNCHER ARGS...: one training run into $OUT/NAME, its output in $OUT/NAME.log
  local name=$1 launcher=$2; shift 2
  rm -rf "${OUT:?}/$name"
  $launcher -q $COMMON "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name rc $?"
  tail -n 2 "$OUT/$name.log"
}

if [[ " $PARTS " == *" small "* ]]; then
  run small-1gpu "python3 -m stableflash.cli train" $SMALL
  run small-ddp "$TORCHRUN" $SMALL
  run small-fsdp "$TORCHRUN" $SMALL --set parallel=fsdp
  ls -la "$OUT/small-fsdp/ckpt/"* 2>/dev/null | tail -n 4
  python3 benchmarks/runs/compare_runs.py "$OUT/small-1gpu" "$OUT/small-ddp" "$OUT/small-fsdp" --warm $WARM \
    --json "$OUT/compare-small.json"
fi
if [[ " $PARTS " == *" medium "* ]]; then
  run medium-1gpu "python3 -m stableflash.cli train" $MEDIUM
  run medium-fsdp "$TORCHRUN" $MEDIUM --set parallel=fsdp
  python3 benchmarks/runs/compare_runs.py "$OUT/medium-1gpu" "$OUT/medium-fsdp" --warm $WARM \
    --json "$OUT/compare-medium.json"
fi

# the table, last: every run against its one-GPU run
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = []
for part in ("small", "medium"):
    path = out / f"compare-{part}.json"
    if not path.exists():
        continue
    for r in json.loads(path.read_text()):
        summary = Path(r["run"]) / "summary.json"
        s = json.loads(summary.read_text()) if summary.exists() else {}
        rows.append({**r, "part": part, "name": Path(r["run"]).name, "status": s.get("status"),
                     "world_size": s.get("world_size")})
(out / "fsdp_check.json").write_text(json.dumps(rows, indent=1))
fmt = lambda v, f: "-" if v is None else format(v, f)
print("| run | status | steps | final loss | max |Δloss| vs 1 GPU | mean |Δloss| | tokens/s | scaling |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['name']} | {r['status']} | {r['steps']} | {fmt(r['final_loss'], '.5f')} | "
          f"{fmt(r['max_abs_loss_diff'], '.1e')} | {fmt(r['mean_abs_loss_diff'], '.1e')} | "
          f"{fmt(r['median_tokens_per_s'], ',.0f')} | {fmt(r['speed_ratio'], '.2f')}x |")
print(f"JSON: {out / 'fsdp_check.json'}")
EOF
