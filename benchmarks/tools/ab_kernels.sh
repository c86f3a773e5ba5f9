#!/usr/bin/env bash
# Kernel timings of two source trees in one device run (an A/B of a kernel change):
#   bash benchmarks/tools/ab_kernels.sh OLD_SRC [VAR=value ... for tune_attention.py, e.g. RULES=0,2 FWD_ONLY=1]
# OLD_SRC is a copy of an earlier src/ (e.g. `git archive HEAD src | tar x -C .ab/head`, carried);
# the working tree's src/ is B. Both run benchmarks/tools/tune_attention.py (fixed configs, medians of
# do_bench) on the same GPU, one after the other; tables and JSON under $OUT/ab-{A,B}.*.
#
# AB_CMD set: that command instead of tune_attention.py, run ROUNDS times (default 2) in the order
# A B A B …, each run's output in $OUT/ab-{A,B}-<round>.txt and its last TAIL lines (default 30) shown,
# e.g. AB_CMD="python3 benchmarks/tools/gluon_forward_check.py --time --shapes 32,12,1024,64" — so
# that a drift of the GPU between runs shows as a difference between rounds, not between trees.
set -uo pipefail
old=$1; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
tree() { [ "$1" = A ] && echo "$old" || echo "$PWD/src"; }   # side A or B's src/
if [ -n "${AB_CMD:-}" ]; then
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for side in A B; do
      src=$(tree $side)
      echo "== round $round, $side: $src"
      env "$@" PYTHONPATH="$src" bash -c "$AB_CMD" > "$OUT/ab-$side-$round.txt" 2>&1
      tail -n "${TAIL:-30}" "$OUT/ab-$side-$round.txt"
    done
  done
  exit 0
fi
for side in A B; do
  src=$(tree $side)
  echo "== $side: $src"
  env "$@" OUT="$OUT" PYTHONPATH="$src" python3 benchmarks/tools/tune_attention.py > "$OUT/ab-$side.txt" 2>&1
  mv "$OUT/tune.json" "$OUT/ab-$side.json" 2>/dev/null
  grep -A100 "best ms" "$OUT/ab-$side.txt"
done
