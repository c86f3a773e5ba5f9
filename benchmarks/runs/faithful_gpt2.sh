#!/usr/bin/env bash
# Faithful bf16 GPT-2 small runs on the installed-packages corpus (docs/reproduction.md, "GPT-2 small,
# faithful bf16"). The authors' recipe (preset gpt2-small-paper: AdamW (0.9, 0.95), wd 0, 2000
# warm-up steps to 1e-3, cosine over 600K steps, clip 1.0, bf16 autocast, compiled) with 16 × 1024
# tokens per micro-batch and 8 micro-batches per step on two GPUs (131,072 tokens), 4 on one
# (65,536 tokens); no stabilization. Verbs (repository root, on the GPU machine):
#   bash benchmarks/runs/faithful_gpt2.sh prepare
#       the corpus into $DATA (default /tmp/data/packages): `stableflash data prepare --packages`,
#       timed; prints its fingerprint (the same on every machine of one image)
#   bash benchmarks/runs/faithful_gpt2.sh start NAME SEED ATTENTION [--set KEY=VALUE ...]
#       starts the run detached (benchmarks/runs/repro_detached.sh command), out /tmp/detached/NAME;
#       ATTENTION: paper (the authors' arithmetic: "paper" policy, key block 512), fa2 (real
#       FlashAttention-2 arithmetic), or an attention spec; per-step loss, probes every 100 steps
#       (W_Q spectral norms per head, repeated row maxima per layer), the monitor warning, and the
#       batch order recorded (RUN/batches)
#   then: KEEP_BATCHES=1 bash benchmarks/runs/repro_detached.sh wait SECONDS   (packs $OUT/detached.tgz)
set -u
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
DATA=${DATA:-/tmp/data/packages}
root=${DETACHED_ROOT:-/tmp/detached}; mkdir -p "$root"
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
  start)
    name=$2; seed=$3; attention=$4; shift 4
    case $attention in
      paper) attention="triton stabilize=none policy=paper block=512";;
      fa2) attention="triton stabilize=none policy=fa2";;
    esac
    gpus=$(nvidia-smi -L | wc -l)
    if [ "$gpus" -ge 2 ]; then launch=(torchrun --standalone --nproc_per_node=2 -m stableflash.cli); accum=8
    else launch=(python3 -m stableflash.cli); accum=4; fi
    bash benchmarks/runs/repro_detached.sh command "$name" "${launch[@]}" train --preset gpt2-small-paper \
      --out "$root/$name" --set data="$DATA" --set batch_size=16 --set grad_accum=$accum \
      --set max_iters="${STEPS:-7000}" --set seed="$seed" --set attention="$attention" \
      --set probe_every=100 --set monitor=warn --set log_every=1 --set eval_every=1000 --set eval_iters=20 \
      --set ckpt_every=1000 --set stop_after_explosion=200 "$@";;
  *) echo "usage: $0 prepare | start NAME SEED ATTENTION [--set KEY=VALUE ...]"; exit 2;;
esac
