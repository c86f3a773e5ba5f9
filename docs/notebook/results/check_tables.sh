#!/usr/bin/env bash
# Re-run, on the committed run archives (the compact ones of docs/notebook/results/compact_runs.py), every
# command that made a text table of docs/notebook/results/*/ and compare its output with the committed file:
# the lines a script printed byte for byte (the hand-written "# ..." / "command: ..." lines at a
# file's top are not the script's output and are left out of the comparison), and the JSON the same
# command wrote where the folder holds one. Prints one line per table, OK, DIFFERS or MISSING (no
# committed or no produced output), and exits 1 if any differs or is missing. About 3 minutes on 2 CPU
# cores.
#
#     PYTHONPATH=src bash docs/notebook/results/check_tables.sh [WORK_DIR]
#
# Each command is the one at the top of its table or in its folder's README, with the folders the
# archives are unpacked into moved under WORK_DIR (default: a new temporary folder). With
# FROM_COMMIT=REV the archives are read as they were at git revision REV (e.g. 43fce87, the last
# commit with the full archives), so that two runs' WORK_DIRs can be compared file by file: a table
# the scripts of today no longer print as committed (written by an earlier version of the script)
# comes out the same from the full and the compact archives.
set -u
repo=$(cd "$(dirname "$0")/../../.." && pwd)
R=$repo/docs/notebook/results
B=$repo/benchmarks/runs
W=${1:-$(mktemp -d)}
mkdir -p "$W"
cd "$W" || exit 1
failed=0

at_commit() {   # at_commit REV PATH: a file under docs/notebook/results/ as at REV, where commits before
                # aa242de kept these folders in docs/results/
  git -C "$repo" show "$1:$2" 2>/dev/null || git -C "$repo" show "$1:${2/#docs\/notebook\/results/docs/results}"
}
unpack() {   # unpack FOLDER DEST [MEMBER ...]: a results folder's runs.tar.xz into DEST
  local folder=$1 dest=$2; shift 2
  mkdir -p "$dest" || return 1
  if [ -n "${FROM_COMMIT:-}" ]; then
    at_commit "$FROM_COMMIT" "docs/notebook/results/$folder/runs.tar.xz" | tar xJf - -C "$dest" "$@"
  else
    tar xJf "$R/$folder/runs.tar.xz" -C "$dest" "$@"
  fi
}
body() { grep -v -e '^#' -e '^command:' "$1"; }   # a table without its hand-written header lines
missing() {   # missing NAME COMMITTED PRODUCED: true (and the table fails) if either is absent or empty
  if [ -s "$2" ] && [ -s "$3" ]; then return 1; fi
  echo "MISSING  $1 (committed: $2, produced: $3)"; failed=1
}
check() {    # check NAME COMMITTED_FILE PRODUCED_FILE
  missing "$@" && return
  if diff <(body "$2") <(body "$3") >/dev/null; then echo "OK       $1"
  else echo "DIFFERS  $1"; diff <(body "$2") <(body "$3") | head -5; failed=1; fi
}
check_old() {   # check_old NAME COMMITTED PRODUCED: a table an earlier version of its script wrote
  missing "$@" && return
  if diff <(body "$2") <(body "$3") >/dev/null; then echo "OK       $1"
  else echo "CHANGED  $1 (written by an earlier monitor_sweep.py; FROM_COMMIT=43fce87 gives the same output)"; fi
}
committed() {   # a results file as committed; one no longer in the tree (sinks.json) as at 43fce87
  if [ -f "$1" ]; then cat "$1"; else at_commit 43fce87 "${1#$repo/}"; fi
}
check_json() {   # check_json NAME COMMITTED PRODUCED [SED]: JSON, run paths rewritten by SED
  if [ -z "$(committed "$2" 2>/dev/null)" ] || [ ! -s "$3" ]; then
    echo "MISSING  $1 (committed: $2, produced: $3)"; failed=1; return
  fi
  if diff <(committed "$2") <(sed "${4:-}" "$3") >/dev/null; then echo "OK       $1"
  else echo "DIFFERS  $1"; diff <(committed "$2") <(sed "${4:-}" "$3") | head -5; failed=1; fi
}

# --- outcomes (benchmarks/runs/run_outcomes.py) --------------------------------------------------
for f in mitigations-H200-2026-11-23f mitigations-H200-2026-11-23g mitigations-H200-2026-11-23h \
         mitigations-H200-2026-11-24 mitigations-H100-2026-11-24; do
  unpack $f "$W/$f/runs"
  (cd "$W/$f" && python "$B/run_outcomes.py" runs --json outcomes.json > outcomes.txt)
  check "$f/outcomes.txt" "$R/$f/outcomes.txt" "$W/$f/outcomes.txt"
  check_json "$f/outcomes.json" "$R/$f/outcomes.json" "$W/$f/outcomes.json"
done
for f in "mitigations-H200-2026-11-23b sess-c sess-d" "mitigations-H200-2026-11-23c sess-e sess-f" \
         "mitigations-H200-2026-11-23d sess-g sess-h"; do
  set -- $f
  unpack $1 "$W/$1"
  (cd "$W/$1" && python "$B/run_outcomes.py" $2 $3 --json outcomes.json > outcomes.txt)
  check "$1/outcomes.txt" "$R/$1/outcomes.txt" "$W/$1/outcomes.txt"
  [ -f "$R/$1/outcomes.json" ] && check_json "$1/outcomes.json" "$R/$1/outcomes.json" "$W/$1/outcomes.json"
done

# --- mean loss over 100 steps (benchmarks/runs/loss_at.py) ----------------------------------------
unpack mitigations-H200-2026-11-23d "$W/p23d"
x=$W/mitigations-H200-2026-11-23f/runs
{ python "$B/loss_at.py" 4000 "$W/p23d/sess-g/m-o16-norule12" "$W/p23d/sess-g/m-o16-norule-e5m2" \
    "$x/r-o16r-fp8" "$x/x-fp8-qknorm" "$x/x-fp8-softcap"
  python "$B/loss_at.py" 5000 "$W/p23d/sess-g/m-o32c-norule" "$x/r-oplusr-e8m4"; } > 23f-loss-at.txt
check mitigations-H200-2026-11-23f/loss-at.txt "$R/mitigations-H200-2026-11-23f/loss-at.txt" 23f-loss-at.txt
g=$W/mitigations-H200-2026-11-23g/runs
python "$B/loss_at.py" 5000 "$x/r-oplusr-e8m4" "$g/x-e8m4-qknorm" "$g/x-e8m4-softcap" > 23g-loss-at.txt
check mitigations-H200-2026-11-23g/loss-at.txt "$R/mitigations-H200-2026-11-23g/loss-at.txt" 23g-loss-at.txt
h=$W/mitigations-H200-2026-11-23h/runs
{ python "$B/loss_at.py" 2500 "$h/fmt-e5m2-switch-logit" "$W/p23d/sess-g/m-o16-norule-e5m2"
  python "$B/loss_at.py" 6000 "$h/l6-llama-fp8-guard" "$h/l6-llama-fp8-qk" "$W/p23d/sess-h/g-llama-fp8"; } > 23h-loss-at.txt
check mitigations-H200-2026-11-23h/loss-at.txt "$R/mitigations-H200-2026-11-23h/loss-at.txt" 23h-loss-at.txt
i=$W/mitigations-H200-2026-11-24/runs
{ python "$B/loss_at.py" 5000 "$i/x-e8m4-switch-logit" "$i/x-e8m4-recompute" "$x/r-oplusr-e8m4"
  python "$B/loss_at.py" 4000 "$i/x-fp8-switch-logit" "$i/x-fp8-recompute" "$x/r-o16r-fp8"; } > 24-loss-at.txt
check mitigations-H200-2026-11-24/loss-at.txt "$R/mitigations-H200-2026-11-24/loss-at.txt" 24-loss-at.txt
l=$W/mitigations-H100-2026-11-24/runs
{ python "$B/loss_at.py" 5000 "$l/l-llama-e8m4-guard" "$l/l-llama-e8m4-base"
  python "$B/loss_at.py" 2500 "$l/l-llama-e5m2-guard"; } > h100-loss-at.txt
check mitigations-H100-2026-11-24/loss-at.txt "$R/mitigations-H100-2026-11-24/loss-at.txt" h100-loss-at.txt
unpack cpu-fp8-2026-11-23e "$W/cpuf"; unpack cpu-fp8-2026-11-23g "$W/cpug"; unpack cpu-fp8-2026-11-23f "$W/cpuf23f"
python "$B/loss_at.py" 2600 "$W/cpug/cpusw" "$W/cpuf/rp0" "$W/cpug/cpusw1" "$W/cpuf23f" > cpu23g-loss-at.txt
check cpu-fp8-2026-11-23g/loss-at.txt "$R/cpu-fp8-2026-11-23g/loss-at.txt" cpu23g-loss-at.txt

# --- attention sinks (benchmarks/runs/sink_frequency.py) ------------------------------------------
(cd "$W/mitigations-H200-2026-11-23c" && python "$B/sink_frequency.py" sess-f/a-llama-fp8/seed{0,1,2}/baseline \
   --json sinks.json > sinks.txt)
check mitigations-H200-2026-11-23c/sinks.txt "$R/mitigations-H200-2026-11-23c/sinks.txt" "$W/mitigations-H200-2026-11-23c/sinks.txt"
check_json mitigations-H200-2026-11-23c/sinks.json "$R/mitigations-H200-2026-11-23c/sinks.json" "$W/mitigations-H200-2026-11-23c/sinks.json"
(cd "$W/mitigations-H200-2026-11-23h" && python "$B/sink_frequency.py" runs/l6-llama-fp8-guard/seed{0,1,2}/baseline \
   runs/l6-llama-fp8-qk/seed{0,1,2}/baseline --json sinks.json > sinks.txt)
check mitigations-H200-2026-11-23h/sinks.txt "$R/mitigations-H200-2026-11-23h/sinks.txt" "$W/mitigations-H200-2026-11-23h/sinks.txt"
check_json mitigations-H200-2026-11-23h/sinks.json "$R/mitigations-H200-2026-11-23h/sinks.json" "$W/mitigations-H200-2026-11-23h/sinks.json"
(cd "$W/mitigations-H100-2026-11-24" && python "$B/sink_frequency.py" runs/l-llama-e8m4-{base,guard}/seed{0,1,2}/baseline \
   runs/l-llama-e5m2-{base,guard}/seed{0,1,2}/baseline --json sinks.json > sinks.txt)
check mitigations-H100-2026-11-24/sinks.txt "$R/mitigations-H100-2026-11-24/sinks.txt" "$W/mitigations-H100-2026-11-24/sinks.txt"
check_json mitigations-H100-2026-11-24/sinks.json "$R/mitigations-H100-2026-11-24/sinks.json" "$W/mitigations-H100-2026-11-24/sinks.json"

# --- largest logits (benchmarks/runs/max_logit.py) --------------------------------------------------
unpack mitigations-H200-2026-11-22 "$W/pb" sess/fa2-e8m4
python "$B/max_logit.py" "$g/x-e8m4-paper2" "$W/pb/sess/fa2-e8m4" --every 300 > paper2-max-logit.txt
check mitigations-H200-2026-11-23g/paper2-max-logit.txt "$R/mitigations-H200-2026-11-23g/paper2-max-logit.txt" paper2-max-logit.txt

# --- the monitor's thresholds replayed (benchmarks/runs/monitor_sweep.py) ----------------------------
(cd "$W/mitigations-H200-2026-11-23c" && python "$B/monitor_sweep.py" sess-e sess-f --json monitor-sweep.json > monitor-sweep.txt)
check_old mitigations-H200-2026-11-23c/monitor-sweep.txt "$R/mitigations-H200-2026-11-23c/monitor-sweep.txt" "$W/mitigations-H200-2026-11-23c/monitor-sweep.txt"
check_old mitigations-H200-2026-11-23c/monitor-sweep.json "$R/mitigations-H200-2026-11-23c/monitor-sweep.json" "$W/mitigations-H200-2026-11-23c/monitor-sweep.json"
(cd "$W/mitigations-H200-2026-11-23d" && python "$B/monitor_sweep.py" sess-g/fmt-e5m2-p50 --json monitor-sweep-p50.json > monitor-sweep-p50.txt)
check_old mitigations-H200-2026-11-23d/monitor-sweep-p50.txt "$R/mitigations-H200-2026-11-23d/monitor-sweep-p50.txt" "$W/mitigations-H200-2026-11-23d/monitor-sweep-p50.txt"
check_old mitigations-H200-2026-11-23d/monitor-sweep-p50.json "$R/mitigations-H200-2026-11-23d/monitor-sweep-p50.json" "$W/mitigations-H200-2026-11-23d/monitor-sweep-p50.json"
# 2026-11-22: its runs and the repro-kernel-paper-e8m5 session's, in one folder "runs"
mkdir -p s22 && unpack mitigations-H200-2026-11-22 s22/runs && unpack repro-kernel-paper-e8m5-H200 s22/runs
(cd s22/runs && python "$B/monitor_sweep.py" . --json ../monitor-sweep.json > ../monitor-sweep.txt)
check_old mitigations-H200-2026-11-22/monitor-sweep.txt "$R/mitigations-H200-2026-11-22/monitor-sweep.txt" s22/monitor-sweep.txt
check_old mitigations-H200-2026-11-22/monitor-sweep.json "$R/mitigations-H200-2026-11-22/monitor-sweep.json" s22/monitor-sweep.json
# 2026-11-23b: four folders' runs in one, the monitor-switch runs removed
for f in "repro-kernel-paper-e8m5-H200 base" "mitigations-H200-2026-11-22 s22" "mitigations-H200-2026-11-23 s23" \
         "mitigations-H200-2026-11-23b snew"; do
  set -- $f; unpack $1 "$W/sweep/$2"; done
grep -l '"monitor": "switch"' -r "$W/sweep" --include=config.json | xargs -r -n1 dirname | xargs -r rm -r
python "$B/monitor_sweep.py" "$W/sweep" --json sweep23b.json > sweep23b.txt
check_old mitigations-H200-2026-11-23b/monitor-sweep.txt "$R/mitigations-H200-2026-11-23b/monitor-sweep.txt" sweep23b.txt
check_old mitigations-H200-2026-11-23b/monitor-sweep.json "$R/mitigations-H200-2026-11-23b/monitor-sweep.json" sweep23b.json "s|$W/sweep|/tmp/sweep|g"
# 2026-11-23g: every archive committed at that folder's commit (8e8a4e9), each in a folder of its name
for f in cpu-fp8-2026-11-23e cpu-fp8-2026-11-23f mitigations-H200-2026-11-22 mitigations-H200-2026-11-23 \
         mitigations-H200-2026-11-23b mitigations-H200-2026-11-23c mitigations-H200-2026-11-23d \
         mitigations-H200-2026-11-23f mitigations-H200-2026-11-23g repro-kernel-paper-e8m5-H200; do
  unpack $f "$W/sweep2/$f"; done
(cd "$W/sweep2" && python "$B/monitor_sweep.py" . --json ../sweep-all.json > ../sweep-all.txt)
check mitigations-H200-2026-11-23g/monitor-sweep-all.txt "$R/mitigations-H200-2026-11-23g/monitor-sweep-all.txt" sweep-all.txt
check_json mitigations-H200-2026-11-23g/monitor-sweep-all.json "$R/mitigations-H200-2026-11-23g/monitor-sweep-all.json" sweep-all.json
python "$B/max_logit.py" "$W/sweep2/mitigations-H200-2026-11-23d" "$W/sweep2/mitigations-H200-2026-11-23g/fmt-e5m2-switch" \
  --edge 110 --every 500 > max-logit-guard.txt
check mitigations-H200-2026-11-23g/max-logit-guard-and-e5m2.txt "$R/mitigations-H200-2026-11-23g/max-logit-guard-and-e5m2.txt" max-logit-guard.txt
# faithful GPT-2: the table made again from the compact record the first command wrote (runs.json, kept xz-compressed)
python "$B/faithful_report.py" --from "$R/faithful-gpt2-2026-11-24/runs.json.xz" --out faithful > /dev/null
check faithful-gpt2-2026-11-24/table.txt "$R/faithful-gpt2-2026-11-24/table.txt" faithful/table.txt
check_json faithful-gpt2-2026-11-24/table.json "$R/faithful-gpt2-2026-11-24/table.json" faithful/table.json

exit $failed
