#!/usr/bin/env bash
# One device session: environment, kernel-vs-emulation agreement, the GPU tests of the Triton
# kernels, then the attention benchmark.
# Usage (repository root, on the GPU machine): bash benchmarks/gpu_check.sh [bench args...]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/env.txt"
if [ "${SKIP_DIAG:-0}" != 1 ]; then
  python3 benchmarks/diag_agreement.py 2>&1 | tee "$OUT/diag.txt" | tail -40
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q --tb=line tests/attention/test_triton.py tests/attention/test_dropin.py tests/integrations -p no:cacheprovider 2>&1 | tee "$OUT/pytest-triton.txt" | tail -25
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m stableflash.cli bench attention --out "$OUT/bench.json" "$@" 2>&1 | grep -v "it/s\]" | tee "$OUT/bench.txt"
fi
