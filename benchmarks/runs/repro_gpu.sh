#!/usr/bin/env bash
# Reproduction runs on the lent GPU, with what comes back packed under $OUT.
#   bash benchmarks/runs/repro_gpu.sh SECONDS PRESET [repro options ...]
# runs `stableflash repro --preset PRESET --no-probe -q ...` for at most SECONDS, then packs every
# run's metrics, probes, events and summaries (not the checkpoints) into $OUT/runs-PRESET.tgz and
# prints each run's last logged loss. A run cut off by the time limit keeps the steps it logged.
set -u
limit=$1; preset=$2; shift 2
out=${OUT:-/tmp}
runs=/tmp/repro-runs/$preset
export PYTHONPATH=src
python3 -c "from stableflash.train.corpus import default_data_dir as d; d()" 2>/dev/null
timeout "$limit" python3 -m stableflash.cli repro --preset "$preset" --no-probe -q --out "$runs" "$@" \
    > "$out/repro-$preset.txt" 2>&1
echo "exit $? (124: cut off at ${limit}s)" >> "$out/repro-$preset.txt"
# timeout signals its whole process group, the worker processes included
sleep 3
tar czf "$out/runs-$preset.tgz" --exclude='*.pt' -C "$runs" .
grep -v '^step .*monitor' "$out/repro-$preset.txt" | tail -20
for f in "$runs"/seed*/*/metrics.jsonl; do
    python3 - "$f" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
losses = [r for r in rows if "loss" in r]
if losses:
    last = losses[-1]
    best = min(r["loss"] for r in losses)
    print(f"{sys.argv[1].split('repro-runs/')[1]:45s} step {last['step']:>5}  loss {last['loss']:.3f}  min {best:.3f}")
PY
done
