#!/usr/bin/env bash
# Grow data/smollm2-135m from the imported prompts (PROMPTS, default prompts/train; `dominospec
# import-prompts`) in chunks, each its own resumable prepare-data run and, once complete, the data
# set's next part.
#
# Chunk k holds the prompts [k*CHUNK, (k+1)*CHUNK) of `mix:PROMPTS` drawn with SEED (the
# categories take turns, so every chunk mixes them evenly); the last chunk ends at the folder's last
# prompt, and the script stops at a chunk that would start past it. Rerun the same command to resume: a
# finished chunk is already a part (nothing to do), a killed one restarts at its last finished shard.
# Chunks of prompts/train run as runs/data/mix-sSEED-cK, of another folder as runs/data/FOLDER-sSEED-cK.
#
#   FEATURES=/path/outside/git FIRST=0 LAST=18 scripts/grow_data.sh
#   FEATURES=/path/outside/git PROMPTS=prompts/passages FIRST=0 LAST=0 scripts/grow_data.sh
#
# DOMINOSPEC: how to call the CLI (default `dominospec`); PYTHON: the interpreter that reads the folder's
# sources.json (default `python3`; any Python 3 will do); the features the generating passes compute go to
# FEATURES, for `train --feature-cache FEATURES`.
set -euo pipefail
FIRST=${FIRST:-0}
LAST=${LAST:-18}
CHUNK=${CHUNK:-384}
SEED=${SEED:-21}
PROMPTS=${PROMPTS:-prompts/train}
TAG=mix
[[ "$PROMPTS" == prompts/train ]] || TAG=$(basename "$PROMPTS")
FEATURES=${FEATURES:?set FEATURES to a feature cache folder outside the repository}
read -r -a CLI <<< "${DOMINOSPEC:-dominospec}"
# the folder's prompt count (its sources.json): the last chunk ends there, and a chunk past it is not run
TOTAL=$("${PYTHON:-python3}" -c 'import json, sys; print(sum(s["count"] for s in json.load(open(sys.argv[1]))["sources"].values()))' \
    "$PROMPTS/sources.json")
for k in $(seq "$FIRST" "$LAST"); do
    START=$((k * CHUNK))
    END=$(((k + 1) * CHUNK < TOTAL ? (k + 1) * CHUNK : TOTAL))
    if ((START >= TOTAL)); then
        echo "[grow_data] chunk $k: $PROMPTS holds $TOTAL prompts, all drawn by earlier chunks; stopping"
        break
    fi
    echo "[grow_data] chunk $k: prompts $START..$END of $TOTAL $(date -u +%FT%TZ)"
    "${CLI[@]}" prepare-data --target smollm2-135m --threads 1 --max-new-tokens 384 --temperature 0.7 \
        --top-p 0.8 --batch-size 32 --shard-size 128 --sampler slots \
        --prompts "mix:$PROMPTS:$END" --seed "$SEED" --skip "$START" \
        --out "runs/data/$TAG-s$SEED-c$k" --extend data/smollm2-135m --feature-cache "$FEATURES"
    echo "[grow_data] chunk $k done $(date -u +%FT%TZ)"
done
