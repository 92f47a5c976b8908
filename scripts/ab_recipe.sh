#!/bin/bash
# The recipe comparison of docs/shipped-drafter.md: the same 256 samples, the same epochs, one variant changed
# at a time; compare the validation tau in runs/ab/*/metrics.jsonl.
# Data: the first 4 shards (256 conversations) of the prepare-data run behind data/smollm2-135m part-000
# (dominospec prepare-data --prompts builtin:1024 --seed 11 --max-new-tokens 384 --batch-size 32 --shard-size 64),
# copied with their stats into runs/data/ab and a meta.json marked complete. Variants share one feature cache.
# Only the first six variants were run for the published table (the time ran out before headoff and dense).
cd "$(dirname "$0")/.." && . .venv/bin/activate
D=runs/data/ab
C="--data $D --layers 1 --draft-vocab 8192 --batch-size 4 --save-every 1000 --threads 1 --feature-cache runs/features --val-every 48 --save-dtype float16"
run() { name=$1; shift; [ -f runs/ab/$name/config.json ] && return; s=$(date +%s);
  taskset -c 1 dominospec train $C --out runs/ab/$name "$@" > runs/ab/$name.log 2>&1; echo "$name $(( $(date +%s) - s ))s rc=$?" >> runs/ab/times.txt; }
mkdir -p runs/ab
run kl50 --head domino --block-size 8 --anchors 32 --epochs 3 --distill 0.5
run base --head domino --block-size 8 --anchors 32 --epochs 3
run kl100 --head domino --block-size 8 --anchors 32 --epochs 3 --distill 1.0
run initl --head domino --block-size 8 --anchors 32 --epochs 3 --init-from-layer 29
run b4 --head domino --block-size 4 --anchors 32 --epochs 3
run ep8 --head domino --block-size 8 --anchors 32 --epochs 8
run headoff --head none --block-size 8 --anchors 32 --epochs 3
run dense --head domino --block-size 8 --anchors 0 --epochs 3
echo ALL DONE >> runs/ab/times.txt
