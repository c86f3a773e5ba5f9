#!/bin/bash
# The speed figures README.md, docs/kernels.md ("Speed") and docs/training.md state, measured on this GPU
# in one folder, then summarised:
#
#   bash benchmarks/tools/speed_tables.sh OUT_DIR
#
# Steps, each writing OUT_DIR/<step>.json and <step>.txt:
#   attention-causal-BxHxNxd and attention-no-mask-BxHxNxd (five shapes each; no commas in file names, which some
#     file transfers refuse): `stableflash bench attention --shape B,H,N,d`
#     with every peer, forward and forward + backward, CUDA-graph timing, (B, N, 3, H, d) inputs: each
#     provider checked against float64 first, then TFLOP/s;
#   train-b16-compiled, train-b16-eager, train-b4-graphs, train-b4-compiled, train-b4-eager: GPT-2 small
#     training steps interleaved with SDPA's default (benchmarks/tools/train_interleaved.py), each with a
#     fresh inductor cache;
#   bench-train: `stableflash bench train` (tokens/s, MFU, peak memory; the stabilized and unstabilized
#     kernels beside SDPA).
# OUT_DIR/progress gets a line "<step> <exit status> <seconds>" per step run. A step recorded with status 0
# is skipped when the script runs again on the same folder, so a run cut short (a machine lent for a few
# minutes at a time) goes on where it stopped. Last, benchmarks/tools/speed_summary.py writes
# OUT_DIR/summary.md and summary.json from whatever steps have finished, and prints the markdown.
#
# Environment: SPEED_PYTHON (default python), SPEED_STEP_TIMEOUT (seconds a step may take, default 1800),
# SPEED_STEPS (a space-separated subset of the step names above, default all). The package's sources are
# put first on PYTHONPATH, so the script runs from a checkout without an install.
set -u
if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: bash benchmarks/tools/speed_tables.sh OUT_DIR" >&2
  exit 2
fi
out=$1
repo=$(cd "$(dirname "$0")/../.." && pwd)
py=${SPEED_PYTHON:-python}
limit=${SPEED_STEP_TIMEOUT:-1800}
case $limit in ''|*[!0-9]*|0) echo "SPEED_STEP_TIMEOUT=$limit is invalid; accepted: a positive number of seconds" >&2; exit 2;; esac

# the Hopper route's five shapes (stableflash.bench.attention.ROUTE_SHAPES, which speed_summary.py reads)
shapes="32x12x1024x64 16x16x2048x64 8x16x2048x128 8x16x4096x64 4x16x8192x128"
providers="stableflash stableflash-none stableflash-portable sdpa-default sdpa-flash sdpa-cudnn sdpa-efficient flex"
all_steps=""
for s in $shapes; do all_steps="$all_steps attention-causal-$s"; done
for s in $shapes; do all_steps="$all_steps attention-no-mask-$s"; done
all_steps="$all_steps train-b16-compiled train-b16-eager train-b4-graphs train-b4-compiled train-b4-eager bench-train"
steps=${SPEED_STEPS:-$all_steps}
for step in $steps; do
  case " $all_steps " in *" $step "*) ;; *) echo "SPEED_STEPS names '$step'; accepted:$all_steps" >&2; exit 2;; esac
done

mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
export PYTHONPATH=$repo/src${PYTHONPATH:+:$PYTHONPATH}
cd "$repo" || exit 2
touch "$out/progress"

set_command() {     # cmd=(the step's command)
  local step=$1
  case $step in
    attention-causal-*|attention-no-mask-*)
      cmd=("$py" -m stableflash.cli bench attention)
      [ "${step#attention-no-mask-}" != "$step" ] && cmd+=(--no-causal)
      shape=${step##*-}
      # shellcheck disable=SC2206
      cmd+=(--shape "${shape//x/,}" --providers $providers --modes fwd fwd+bwd --timing graph --layout bnhd
            --out "$out/$step.json");;
    train-b16-compiled) cmd=("$py" benchmarks/tools/train_interleaved.py --batch-size 16 --rounds 30);;
    train-b16-eager) cmd=("$py" benchmarks/tools/train_interleaved.py --no-compile --batch-size 16 --rounds 30);;
    train-b4-graphs) cmd=("$py" benchmarks/tools/train_interleaved.py --batch-size 4 --compile-mode reduce-overhead
                          --rounds 40);;
    train-b4-compiled) cmd=("$py" benchmarks/tools/train_interleaved.py --batch-size 4 --rounds 30 --host-parts);;
    train-b4-eager) cmd=("$py" benchmarks/tools/train_interleaved.py --no-compile --batch-size 4 --rounds 30);;
    bench-train) cmd=("$py" -m stableflash.cli bench train --attention sdpa --attention triton
                      --attention "triton stabilize=none" --out "$out/$step.json");;
  esac
  case $step in train-*) cmd+=(--json "$out/$step.json");; esac
}

for step in $steps; do
  if grep -q "^$step 0 " "$out/progress"; then
    echo "$step: done before, skipped"
    continue
  fi
  set_command "$step"
  echo "$step: ${cmd[*]}"
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  export TORCHINDUCTOR_CACHE_DIR
  t0=$(date +%s)
  timeout "$limit" "${cmd[@]}" > "$out/$step.txt" 2>&1 < /dev/null
  rc=$?
  rm -rf "$TORCHINDUCTOR_CACHE_DIR"
  echo "$step $rc $(( $(date +%s) - t0 ))" >> "$out/progress"
  echo "$step: exit $rc, $(( $(date +%s) - t0 )) s"
done
"$py" benchmarks/tools/speed_summary.py "$out"
