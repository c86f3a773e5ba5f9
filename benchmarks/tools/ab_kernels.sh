#!/usr/bin/env bash
# Kernel timings of two source trees in one device run (an A/B of a kernel change):
#   bash benchmarks/tools/ab_kernels.sh OLD_SRC [VAR=value ... for tune_attention.py, e.g. RULES=0,2 FWD_ONLY=1]
# OLD_SRC is a copy of an earlier src/ (e.g. `git archive HEAD src | tar x -C .ab/head`, carried);
# the working tree's src/ is B. Both run benchmarks/tools/tune_attention.py (fixed configs, medians of
# do_bench) on the same GPU, one after the other; tables and JSON under $OUT/ab-{A,B}.*.
set -uo pipefail
old=$1; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for side in A B; do
  src=$([ $side = A ] && echo "$old" || echo "$PWD/src")
  echo "== $side: $src"
  env "$@" OUT="$OUT" PYTHONPATH="$src" python3 benchmarks/tools/tune_attention.py > "$OUT/ab-$side.txt" 2>&1
  mv "$OUT/tune.json" "$OUT/ab-$side.json" 2>/dev/null
  grep -A100 "best ms" "$OUT/ab-$side.txt"
done
