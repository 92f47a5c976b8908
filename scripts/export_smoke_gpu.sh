#!/usr/bin/env bash
# GPU smoke test of `dominospec export` (not run in CI; needs a CUDA GPU): serve exports with SGLang and with
# vLLM, and check that greedy completions with speculation equal greedy completions without it.
#
# Each engine lives in its own environment (their pins conflict with ours and with each other):
#   SGLANG_PYTHON=/envs/sglang/bin/python VLLM=/envs/vllm/bin/vllm scripts/export_smoke_gpu.sh [sglang|vllm|both]
# DS_PYTHON is a python with dominospec installed (default: python3). Work files go to $WORK (default: a temp dir).
# Targets: the bundled smollm2-135m (its converted directory); mask token 16 is <empty_output>, a SmolLM2 token
# chat never produces. SGLang Domino runs in bf16 only, where a batch-shape rounding difference can flip a near-tied
# token; a mismatch there is reported with its position so it can be told apart from a wrong export.
set -euo pipefail
WHICH=${1:-both}
DS_PYTHON=${DS_PYTHON:-python3}
SGLANG_PYTHON=${SGLANG_PYTHON:-python3}
VLLM=${VLLM:-vllm}
WORK=${WORK:-$(mktemp -d)}
MASK=16
TOKENS=64
ds() { "$DS_PYTHON" -m dominospec.cli "$@"; }
TARGET=$("$DS_PYTHON" -c "from dominospec.targets.load import bundled_model_dir; print(bundled_model_dir('smollm2-135m'))")
echo "work dir: $WORK; target: $TARGET"

SERVER_PID=""
stop_server() { if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=""; fi; }
trap stop_server EXIT

free_port() { "$DS_PYTHON" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

wait_ready() {  # port, log
  for _ in $(seq 1 600); do
    if curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1; then return 0; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "server exited; last lines of $2:"; tail -30 "$2"; return 1; fi
    sleep 1
  done
  echo "server not ready after 600 s; last lines of $2:"; tail -30 "$2"; return 1
}

complete_all() {  # port, output file: greedy completions of fixed prompts, one JSON string per line
  "$DS_PYTHON" - "$1" "$2" "$TOKENS" <<'PY'
import json, sys, urllib.request
port, out, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompts = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.\n",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Translate to French: good morning, my friend.\n",
    "import numpy as np\n\ndef softmax(x):",
]
with open(out, "w") as f:
    for p in prompts:
        body = json.dumps({"model": "target", "prompt": p, "max_tokens": tokens, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            f.write(json.dumps(json.load(r)["choices"][0]["text"]) + "\n")
PY
}

compare() {  # baseline file, speculative file, label
  "$DS_PYTHON" - "$1" "$2" "$3" <<'PY'
import json, sys
a = [json.loads(line) for line in open(sys.argv[1])]
b = [json.loads(line) for line in open(sys.argv[2])]
bad = [(i, next((k for k, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t))))
       for i, (s, t) in enumerate(zip(a, b)) if s != t]
print(f"{sys.argv[3]}: {len(a) - len(bad)}/{len(a)} completions identical with speculation on")
for i, pos in bad:
    print(f"  prompt {i}: first difference at character {pos}: {a[i][pos:pos + 30]!r} vs {b[i][pos:pos + 30]!r}")
sys.exit(1 if bad else 0)
PY
}

serve_and_complete() {  # label, output file, command...
  local label=$1 out=$2; shift 2
  local port; port=$(free_port)
  "$@" --port "$port" > "$WORK/$label.log" 2>&1 &
  SERVER_PID=$!
  wait_ready "$port" "$WORK/$label.log"
  complete_all "$port" "$out"
  stop_server
}

status=0
if [ "$WHICH" = sglang ] || [ "$WHICH" = both ]; then
  # the shipped Domino drafter (approximate: its draft vocabulary is widened) and an untrained DSpark drafter (exact)
  ds export smollm2-135m --to sglang --out "$WORK/sglang-domino" --mask-token-id "$MASK" --allow-approx
  ds init --target smollm2-135m --serve-with sglang --head markov --layers 1 --mask-token-id "$MASK" --out "$WORK/markov-sglang"
  ds export "$WORK/markov-sglang" --to sglang --out "$WORK/sglang-dspark"
  SGL=("$SGLANG_PYTHON" -m sglang.launch_server --model-path "$TARGET" --served-model-name target --dtype bfloat16 --host 127.0.0.1)
  serve_and_complete sglang-base "$WORK/sglang-base.jsonl" "${SGL[@]}"
  serve_and_complete sglang-domino "$WORK/sglang-domino.jsonl" "${SGL[@]}" --speculative-algorithm DFLASH \
    --speculative-draft-model-path "$WORK/sglang-domino" --speculative-domino-candidate-pool-size 0
  compare "$WORK/sglang-base.jsonl" "$WORK/sglang-domino.jsonl" "SGLang DFLASH/Domino" || status=1
  serve_and_complete sglang-dspark "$WORK/sglang-dspark.jsonl" "${SGL[@]}" --speculative-algorithm DSPARK \
    --speculative-draft-model-path "$WORK/sglang-dspark"
  compare "$WORK/sglang-base.jsonl" "$WORK/sglang-dspark.jsonl" "SGLang DSPARK" || status=1
fi
if [ "$WHICH" = vllm ] || [ "$WHICH" = both ]; then
  ds init --target smollm2-135m --serve-with vllm --layers 1 --mask-token-id "$MASK" --out "$WORK/markov-vllm"
  ds export "$WORK/markov-vllm" --to vllm --out "$WORK/vllm-dspark" --dtype fp32
  VL=("$VLLM" serve "$TARGET" --served-model-name target --dtype float32 --host 127.0.0.1)
  serve_and_complete vllm-base "$WORK/vllm-base.jsonl" "${VL[@]}"
  B=$("$DS_PYTHON" -c "import json; print(json.load(open('$WORK/vllm-dspark/config.json'))['block_size'])")
  serve_and_complete vllm-dspark "$WORK/vllm-dspark.jsonl" "${VL[@]}" \
    --speculative-config "{\"method\": \"dspark\", \"model\": \"$WORK/vllm-dspark\", \"num_speculative_tokens\": $B}"
  compare "$WORK/vllm-base.jsonl" "$WORK/vllm-dspark.jsonl" "vLLM dspark" || status=1
fi
exit $status
