#!/usr/bin/env bash
# The CPU measurements behind the README's backend claims (native vs transformers forward, the device profile,
# bench at T=0 and T=1, peak memory, data-generation speed) in one sequential run, 1 thread each; run it with
# nothing else on the CPU. Writes runs/. See scripts/README.md.
set -x
cd "$(dirname "$0")/.."
mkdir -p runs
. .venv/bin/activate
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200 > runs/cpu.txt
python scripts/datagen_speed.py 1 > runs/datagen.txt 2>&1
dominospec profile --backend hf --threads 1 --no-draft --contexts 256,1024 --max-k 17 --repeats 3 --out runs/profile-hf > runs/profile-hf.txt 2>&1
dominospec profile --backend native --threads 1 --contexts 256,1024 --max-k 17 --repeats 3 --out runs/profile-native > runs/profile-native.txt 2>&1
P="--prompts prompts/eval-math.jsonl --prompts prompts/eval-code.jsonl --prompts prompts/eval-chat.jsonl --limit 3"
dominospec bench $P --methods ar,hf,pld,drafters,ablation --max-new-tokens 48 --threads 1 --save-acceptance --out runs/bench-t0 > runs/bench-t0.txt 2>&1
dominospec bench $P --methods ar,hf,pld,drafters,ablation --max-new-tokens 48 --threads 1 --temperature 1.0 --out runs/bench-t1 > runs/bench-t1.txt 2>&1
for be in hf native; do
  /usr/bin/time -v dominospec generate "Write a Python function that checks whether a number is prime." \
      --backend $be --max-new-tokens 48 --threads 1 --json > runs/rss-$be.txt 2>&1
done
echo ALL DONE
