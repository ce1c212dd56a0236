#!/usr/bin/env bash
# Serve smoke on the GPU machine: `perigee serve --backend cuda` and `--backend cpu` on models/default, each sent the
# same chat completion (non-streaming) and the same streaming text completion at temperature 0 with curl; the answers
# must be non-empty and identical across backends. Needs curl and python3 (the GPU image has both, not node).
#
#   PERIGEE=.gpu-carry/bin/perigee tools/gpu/serve-smoke.sh        # run from the repository root
#
# Env: PERIGEE (binary; default .gpu-carry/bin/perigee, else build-rtcuda/tools/perigee), MODEL (models/default),
# PORT_CPU / PORT_CUDA (18431 / 18432), MAX_TOKENS (48), OUT (logs; default ./out-gpu). Prints one PASS/FAIL line per
# check and "serve-smoke: PASS" at the end; exits non-zero on any failure.
set -u
cd "$(dirname "$0")/../.."
PERIGEE=${PERIGEE:-}
if [ -z "$PERIGEE" ]; then
  if [ -x .gpu-carry/bin/perigee ]; then PERIGEE=.gpu-carry/bin/perigee; else PERIGEE=build-rtcuda/tools/perigee; fi
fi
[ -d .gpu-carry/lib ] && export LD_LIBRARY_PATH="$PWD/.gpu-carry/lib:${LD_LIBRARY_PATH:-}"
MODEL=${MODEL:-models/default}
PORT_CPU=${PORT_CPU:-18431}
PORT_CUDA=${PORT_CUDA:-18432}
MAX_TOKENS=${MAX_TOKENS:-48}
SECOND=${SMOKE_SECOND_BACKEND:-cuda}   # dry run on a machine without a GPU: SMOKE_SECOND_BACKEND=cpu
OUT=${OUT:-./out-gpu}
mkdir -p "$OUT"
fail=0
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done; }
trap cleanup EXIT

start() {   # backend port
  "$PERIGEE" serve --backend "$1" --model "$MODEL" --host 127.0.0.1 --port "$2" --max-num-seqs 2 --max-model-len 512 \
    >"$OUT/serve-$1-$2.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 240); do
    if curl -sf "http://127.0.0.1:$2/health" >/dev/null 2>&1; then echo "serve --backend $1: up on port $2"; return 0; fi
    if ! kill -0 "${pids[-1]}" 2>/dev/null; then break; fi
    sleep 0.5
  done
  echo "FAIL serve --backend $1 did not come up on port $2; log:"; tail -20 "$OUT/serve-$1-$2.log"
  return 1
}

chat() {   # port -> the assistant message content
  curl -sf -m 300 "http://127.0.0.1:$1/v1/chat/completions" -H 'Content-Type: application/json' -d "{
      \"messages\": [{\"role\": \"user\", \"content\": \"Speak of the king and the crown.\"}],
      \"temperature\": 0, \"max_tokens\": $MAX_TOKENS}" |
    python3 -c 'import json,sys; m=json.load(sys.stdin)["choices"][0]["message"]; print(json.dumps([m.get("content") or "", m.get("reasoning_content") or ""]))'
}

stream() {   # port -> the concatenated text of a streamed /v1/completions
  curl -sfN -m 300 "http://127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' -d "{
      \"prompt\": \"ROMEO:\\nBut soft, what light through yonder window\", \"temperature\": 0, \"max_tokens\": $MAX_TOKENS,
      \"stream\": true}" |
    python3 -c '
import json, sys
text, done, chunks = "", False, 0
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("data:"): continue
    d = line[5:].strip()
    if d == "[DONE]": done = True; continue
    chunks += 1
    for c in json.loads(d).get("choices", []): text += c.get("text") or ""
if not done: sys.exit("stream ended without data: [DONE]")
print(json.dumps({"text": text, "chunks": chunks}))'
}

start cpu "$PORT_CPU" || exit 1
start "$SECOND" "$PORT_CUDA" || exit 1

for kind in chat stream; do
  a=$($kind "$PORT_CPU"); ra=$?
  b=$($kind "$PORT_CUDA"); rb=$?
  printf '%s\n' "$a" >"$OUT/smoke-$kind-cpu.json"
  printf '%s\n' "$b" >"$OUT/smoke-$kind-$SECOND.json"
  echo "$kind cpu : $a"
  echo "$kind $SECOND: $b"
  if [ $ra -ne 0 ] || [ $rb -ne 0 ]; then echo "FAIL $kind: request failed (cpu rc $ra, cuda rc $rb)"; fail=1; continue; fi
  if ! python3 -c 'import json,sys; v=json.loads(sys.argv[1]); s="".join(v) if isinstance(v,list) else v["text"]; sys.exit(0 if s.strip() else 1)' "$b"; then
    echo "FAIL $kind: empty answer from --backend $SECOND"; fail=1; continue
  fi
  if [ "$a" != "$b" ]; then echo "FAIL $kind: --backend $SECOND answer differs from --backend cpu at temperature 0"; fail=1; continue; fi
  echo "PASS $kind: non-empty, identical on cpu and $SECOND"
done

# Control: the comparison must notice a different answer (a perturbed copy of the cuda answer).
if [ "$(printf '%s' "$b" | sed 's/.$/X/')" != "$b" ]; then echo "PASS control: a perturbed answer compares unequal"; else echo "FAIL control"; fail=1; fi

# Strict backend names: an unknown one is an error naming it.
if "$PERIGEE" generate --backend gpu --model "$MODEL" --ids 1,2,3 -n 1 >"$OUT/bad-backend.log" 2>&1; then
  echo "FAIL --backend gpu was accepted"; fail=1
elif grep -q "'gpu'" "$OUT/bad-backend.log"; then echo "PASS --backend gpu refused: $(grep -o "unknown backend.*" "$OUT/bad-backend.log" | head -1)"
else echo "FAIL --backend gpu refused without naming it: $(tail -1 "$OUT/bad-backend.log")"; fail=1; fi

if [ $fail -eq 0 ]; then echo "serve-smoke: PASS"; else echo "serve-smoke: FAIL"; fi
exit $fail
