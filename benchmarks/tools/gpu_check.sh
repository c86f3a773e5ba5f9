#!/usr/bin/env bash
# One device session: environment, kernel-vs-emulation agreement, the GPU tests of the Triton
# kernels, then the attention benchmark.
# Usage (repository root, on the GPU machine): bash benchmarks/tools/gpu_check.sh [bench args...]
# Env: SKIP_DIAG, SKIP_TESTS, SKIP_BENCH = 1 skip a part; PYTEST_K selects kernel tests; BENCH_LIMIT
# caps the benchmark's seconds. The next session's quiet part, for example:
#   SKIP_DIAG=1 PYTEST_K="16_bit or soft or fp8_tensor_cores" bash benchmarks/tools/gpu_check.sh --modes fwd+bwd \
#     --providers stableflash-none stableflash stableflash-none-o32c stableflash-tie-shift-fp8 stableflash-fp8 \
#     stableflash-fp8-pv stableflash-tie-shift-softcap stableflash-tie-shift-dpp sdpa-flash sdpa-cudnn
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/env.txt"
if [ "${SKIP_DIAG:-0}" != 1 ]; then
  python3 benchmarks/tools/diag_agreement.py 2>&1 | tee "$OUT/diag.txt" | tail -40
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  if [ -n "${PYTEST_K:-}" ]; then       # only the kernel tests matching PYTEST_K (new code first)
    python3 -m pytest -q --tb=line tests/attention/test_triton.py -k "$PYTEST_K" -p no:cacheprovider 2>&1 \
      | tee "$OUT/pytest-triton.txt" | tail -8
  else
    python3 -m pytest -q --tb=line tests/attention/test_triton.py tests/attention/test_dropin.py tests/integrations \
      -p no:cacheprovider 2>&1 | tee "$OUT/pytest-triton.txt" | tail -25
  fi
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  # BENCH_LIMIT seconds at most (default 420; 9 providers at three shapes, fwd+bwd only, took > 330 s
  # on an H200): the JSON is rewritten after every row, so a run cut short keeps what it measured
  timeout "${BENCH_LIMIT:-420}" python3 -m stableflash.cli bench attention --out "$OUT/bench.json" "$@" \
    > "$OUT/bench.txt" 2>&1
  grep -v "it/s\]" "$OUT/bench.txt" | tail -40
  python3 benchmarks/tools/mitigation_costs.py "$OUT/bench.json" 2>/dev/null | tail -14
fi
