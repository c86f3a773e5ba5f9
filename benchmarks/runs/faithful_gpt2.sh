#!/usr/bin/env bash
# Faithful bf16 GPT-2 small runs on the installed-packages corpus (docs/reproduction.md, "GPT-2 small,
# faithful bf16"). The authors' recipe (preset gpt2-small-paper: AdamW (0.9, 0.95), wd 0, 2000
# warm-up steps to 1e-3, cosine over 600K steps, clip 1.0, bf16 autocast, compiled) with 16 × 1024
# tokens per micro-batch and 4 micro-batches per GPU per step: 65,536 tokens on one GPU, 131,072 on
# two (one torchrun process per GPU, DDP); BATCH and ACCUM set the micro-batch and the micro-batches
# per step over all GPUs (the paper's 524,288 tokens on eight: BATCH=32 ACCUM=16); no stabilization.
# Verbs (repository root, on the GPU machine):
#   bash benchmarks/runs/faithful_gpt2.sh prepare
#       the corpus into $DATA (default /tmp/data/packages): `stableflash data prepare --packages`,
#       timed; prints its fingerprint (the same on every machine of one image)
#   bash benchmarks/runs/faithful_gpt2.sh start NAME SEED ATTENTION [--set KEY=VALUE ...]
#       starts the run detached (benchmarks/runs/repro_detached.sh command), out /tmp/detached/NAME;
#       ATTENTION: paper (the authors' arithmetic: "paper" policy, key block 512), fa2 (real
#       FlashAttention-2 arithmetic), fa2-stabilized (the same with stabilize=True, the product's
#       default), or an attention spec; per-step loss, probes every 100 steps
#       (W_Q spectral norms per head, repeated row maxima per layer), the monitor warning, and the
#       batch order recorded (RUN/batches)
#   bash benchmarks/runs/faithful_gpt2.sh fork NAME FROM ATTENTION STEPS [--set KEY=VALUE ...]
#       copies run FROM (its checkpoint: start it with STEPS=N to stop and save at step N) to NAME and
#       resumes the copy detached with ATTENTION (as for start, plus: stabilized = the default
#       stabilization on the authors' arithmetic, paper-beta2 / paper-beta7 = the paper's row-maximum
#       rule, fp32-o = Ō, ℓ and O in fp32, P̄ in bf16, δ from that O) up to step STEPS: the same weights,
#       optimizer state and batch order from FROM's step on
#   bash benchmarks/runs/repro_detached.sh command plan bash benchmarks/runs/faithful_gpt2.sh replays NAME SEED AT STEPS
#       the baseline to step AT, then the five forks above from its checkpoint to STEPS, at once
#   bash benchmarks/runs/repro_detached.sh command queue bash benchmarks/runs/faithful_gpt2.sh queue STEPS NAME SEED ATTENTION ...
#       several runs from step 0 one after another (one GPU runs one at full speed)
#   then: KEEP_BATCHES=1 bash benchmarks/runs/repro_detached.sh wait SECONDS   (packs $OUT/detached.tgz)
# PRESET: another training preset for `start` (the tests run the verbs on "tiny").
set -u
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
DATA=${DATA:-/tmp/data/packages}
root=${DETACHED_ROOT:-/tmp/detached}; mkdir -p "$root"
ended() { while kill -0 -- -"$(cat "$root/$1.pgid")" 2>/dev/null; do sleep 5; done; }   # run NAME's group has ended
case $1 in
  prepare)
    start=$SECONDS
    python3 -m stableflash.cli data prepare --packages --out "$DATA" > "$root/prepare.json" 2> "$root/prepare.log" \
      || { tail -5 "$root/prepare.log"; exit 1; }
    python3 - "$root/prepare.json" "$((SECONDS - start))" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
fp = m["fingerprint"]
print(f"prepared in {sys.argv[2]} s: {fp['documents']} documents, {fp['bytes'] / 1e6:.0f} MB, sha256 {fp['sha256'][:16]}; "
      f"tokens train {m['tokens']['train']:,} val {m['tokens']['val']:,}; vocab {m['vocab_size']} "
      f"(eot {m['eot_token']}); tokenizer.json sha256 {m['tokenizer_sha256'][:16]}")
PY
    ;;
  start|fork)
    verb=$1; name=$2; seed_or_from=$3; attention=$4; shift 4    # start NAME SEED ... | fork NAME FROM ...
    paper="triton policy=paper block=512"
    case $attention in
      paper) attention="$paper stabilize=none";;
      fa2) attention="triton stabilize=none policy=fa2";;
      fa2-stabilized) attention="triton policy=fa2";;      # stabilize=True: what users run
      stabilized) attention="$paper stabilize=consistent-delta";;
      paper-beta2) attention="$paper stabilize=paper beta=2";;
      paper-beta7) attention="$paper stabilize=paper beta=7";;
      fp32-o) attention="$paper stabilize=none acc=fp32 row_sum=fp32 out=fp32 delta=recompute_fp32";;
    esac
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
    if [ "$gpus" -ge 2 ]; then launch=(torchrun --standalone --nproc_per_node="$gpus" -m stableflash.cli)
    else launch=(python3 -m stableflash.cli); gpus=1; fi
    accum=${ACCUM:-$((4 * gpus))}
    if [ "$verb" = fork ]; then
      from=$root/$seed_or_from; steps=$1; shift
      [ -f "$from/ckpt.pt" ] || { echo "fork: $from has no ckpt.pt"; exit 1; }
      rm -rf "$root/$name"; cp -r "$from" "$root/$name"
      bash benchmarks/runs/repro_detached.sh command "$name" "${launch[@]}" train --resume "$root/$name" \
        --set attention="$attention" --set max_iters="$steps" "$@"
      exit
    fi
    bash benchmarks/runs/repro_detached.sh command "$name" "${launch[@]}" train --preset "${PRESET:-gpt2-small-paper}" \
      --out "$root/$name" --set data="$DATA" --set batch_size="${BATCH:-16}" --set grad_accum="$accum" \
      --set max_iters="${STEPS:-7000}" --set seed="$seed_or_from" --set attention="$attention" \
      --set probe_every=100 --set monitor=warn --set log_every=1 --set eval_every=1000 --set eval_iters=20 \
      --set ckpt_every=1000 --set stop_after_explosion=200 "$@";;
  replays)
    # replays NAME SEED AT STEPS: the authors'-arithmetic baseline to step AT (checkpointed there),
    # then its five forks from that checkpoint to step STEPS at once (one GPU holds them):
    # NAME-paper (the baseline continued), NAME-stabilized, NAME-paper-beta2, NAME-paper-beta7,
    # NAME-fp32-o. Start it detached: repro_detached.sh command plan bash $0 replays ...
    name=$2; seed=$3; at=$4; steps=$5
    STEPS=$at bash "$0" start "$name" "$seed" paper
    ended "$name"
    for a in paper stabilized paper-beta2 paper-beta7 fp32-o; do bash "$0" fork "$name-$a" "$name" "$a" "$steps"; done;;
  queue)
    # queue STEPS NAME SEED ATTENTION [NAME SEED ATTENTION ...]: the runs one after another, each to
    # step STEPS (or its own stop: an explosion, a non-finite loss). Start it detached:
    # repro_detached.sh command queue bash $0 queue ...
    steps=$2; shift 2
    while [ $# -ge 3 ]; do
      STEPS=$steps bash "$0" start "$1" "$2" "$3"
      ended "$1"
      shift 3
    done;;
  *) echo "usage: $0 prepare | start NAME SEED ATTENTION [--set KEY=VALUE ...] | fork NAME FROM ATTENTION STEPS [--set KEY=VALUE ...] | replays NAME SEED AT STEPS | queue STEPS NAME SEED ATTENTION ..."; exit 2;;
esac
