#!/usr/bin/env bash
# Reproduction runs that outlive one device call (each call may run 10 minutes; a machine stays
# held for up to 30 while calls follow each other closely). Three verbs:
#   bash benchmarks/runs/repro_detached.sh start NAME PRESET [repro options ...]
#       starts `stableflash repro --preset PRESET --no-probe -q --out /tmp/detached/NAME ...` in its
#       own process session (it keeps running after the call returns)
#   bash benchmarks/runs/repro_detached.sh command NAME CMD [ARGS ...]
#       starts any command the same way (its output in NAME.log; it writes its run where it says,
#       under the same root for `wait` to pack: benchmarks/runs/faithful_gpt2.sh uses it)
#   bash benchmarks/runs/repro_detached.sh wait SECONDS
#       waits SECONDS, or less once every started run's process group has ended, then packs every
#       run's metrics, probes and events (no checkpoints; the recorded batch order too with
#       KEEP_BATCHES=1) into $OUT/detached.tgz and prints each run's last logged loss and step
#   bash benchmarks/runs/repro_detached.sh solo PRESET STEPS [repro options ...]
#       stops the detached runs, then times PRESET's baseline alone for STEPS steps (ms per step)
#   bash benchmarks/runs/repro_detached.sh stop [NAME ...]
#       stops the named detached runs (default: all) with their worker processes: each run is its
#       own process group, recorded at start (a `pkill -f` pattern can match the calling shell, and
#       misses spawn workers, whose command line does not name the run)
set -u
root=${DETACHED_ROOT:-/tmp/detached}; mkdir -p "$root"     # DETACHED_ROOT: another folder (tests)
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
led() {   # led PID: wait (up to 5 s) until PID leads its own process group, so that `wait` and `stop`
          # find the group at once (the child calls setsid only after the fork returned its pid)
  for _ in $(seq 50); do [ "$(ps -o pgid= -p "$1" 2>/dev/null | tr -d ' ')" = "$1" ] && return; sleep 0.1; done
}
case $1 in
  start)
    name=$2; preset=$3; shift 3
    python3 -c "from stableflash.train.corpus import default_data_dir as d; d()" 2>/dev/null
    setsid nohup python3 -m stableflash.cli repro --preset "$preset" --no-probe -q --out "$root/$name" "$@" \
      > "$root/$name.log" 2>&1 < /dev/null &
    echo $! > "$root/$name.pgid"              # setsid: the run leads its own process group
    led $!
    echo "started $name: $preset $*";;
  command)
    name=$2; shift 2
    setsid nohup "$@" > "$root/$name.log" 2>&1 < /dev/null &
    echo $! > "$root/$name.pgid"
    led $!
    echo "started $name: $*";;
  stop)
    shift
    names=${*:-$(ls "$root"/*.pgid 2>/dev/null | xargs -r -n1 basename | sed 's/\.pgid$//')}
    for name in $names; do
      [ -f "$root/$name.pgid" ] && kill -- -"$(cat "$root/$name.pgid")" 2>/dev/null && echo "stopped $name"
      rm -f "$root/$name.pgid"
    done;;
  wait)
    end=$((SECONDS + $2))
    while [ $SECONDS -lt $end ]; do            # the pgid files, not `pgrep -f`, which matches this shell
      alive=0
      for f in "$root"/*.pgid; do [ -f "$f" ] && kill -0 -- -"$(cat "$f")" 2>/dev/null && alive=1; done
      [ $alive = 0 ] && break
      sleep 5
    done
    echo "waited $((SECONDS + $2 - end)) s of $2"
    keep=(--exclude=batches); [ "${KEEP_BATCHES:-0}" = 1 ] && keep=()
    tar czf "$OUT/detached.tgz" --exclude='*.pt' --exclude='*.distcp' "${keep[@]}" -C "$root" .
    for f in $(find "$root" -name metrics.jsonl | sort); do      # repro and ladder layouts alike
      python3 - "$f" <<'PY'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if isinstance(r.get("loss"), float)]  # not "nan" events
if rows:
    print(f"{sys.argv[1].split('detached/')[1]:48s} step {rows[-1]['step']:>6} loss {rows[-1]['loss']:7.3f}"
          f" min {min(r['loss'] for r in rows):.3f} ms {rows[-1].get('ms', 0):.0f}")
PY
    done
    grep -l -i "error\|traceback" "$root"/*.log 2>/dev/null | head;;
  solo)
    bash "$0" stop; sleep 5
    preset=$2; steps=$3; shift 3
    python3 -m stableflash.cli repro --preset "$preset" --no-probe -q --roles baseline --steps "$steps" \
      --out "$root/solo-$preset" "$@" > "$root/solo-$preset.log" 2>&1
    python3 - "$root/solo-$preset/seed0/baseline/metrics.jsonl" <<'PY'
import json, statistics, sys
ms = [json.loads(l)["ms"] for l in open(sys.argv[1]) if '"ms"' in l][2:]
print(f"solo baseline: median {statistics.median(ms):.1f} ms per step over {len(ms)} logged steps")
PY
    tar czf "$OUT/detached.tgz" --exclude='*.pt' --exclude=batches -C "$root" .;;
esac
