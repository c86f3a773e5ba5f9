#!/usr/bin/env bash
# Two-GPU DDP against one GPU with the same global batch and data order: loss curves step by step,
# and tokens/s (the scaling). Needs two GPUs (the device tool's nvidia-h200-x2).
# Usage (repository root, on the GPU machine): bash benchmarks/runs/ddp_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/env.txt"
# 1. the loss curve: the "small" preset (6 layers x 384, context 512), eager, 300 steps of 2 micro-batches
SMALL="--preset small --set max_iters=${SMALL_STEPS:-300} --set grad_accum=2 --set probe_every=0 --set log_every=1
       --set eval_every=100000 --set ckpt_every=100000 --set compile=false"
python3 -m stableflash.cli train $SMALL --out "$OUT/small-1gpu" > "$OUT/small-1gpu.log" 2>&1; echo "small 1 GPU rc $?"
torchrun --standalone --nproc_per_node=2 -m stableflash.cli train $SMALL --out "$OUT/small-2gpu" \
  > "$OUT/small-2gpu.log" 2>&1; echo "small 2 GPUs rc $?"
python3 benchmarks/runs/compare_runs.py "$OUT/small-1gpu" "$OUT/small-2gpu" --json "$OUT/compare-small.json"
# 2. the scaling: GPT-2 small with the paper's recipe (16 micro-batches of 32 x 1024 per step), compiled
GPT2="--preset gpt2-small-paper --set data=embedded --set max_iters=${GPT2_STEPS:-25} --set probe_every=0
      --set log_every=1 --set eval_every=100000 --set ckpt_every=100000"
python3 -m stableflash.cli train $GPT2 --out "$OUT/gpt2-1gpu" > "$OUT/gpt2-1gpu.log" 2>&1; echo "gpt2 1 GPU rc $?"
torchrun --standalone --nproc_per_node=2 -m stableflash.cli train $GPT2 --out "$OUT/gpt2-2gpu" \
  > "$OUT/gpt2-2gpu.log" 2>&1; echo "gpt2 2 GPUs rc $?"
python3 benchmarks/runs/compare_runs.py "$OUT/gpt2-1gpu" "$OUT/gpt2-2gpu" --json "$OUT/compare-gpt2.json"
