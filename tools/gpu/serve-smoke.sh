#!/usr/bin/env bash
# Serve smoke on the GPU machine: `perigee serve --backend cuda` and `--backend cpu` on models/default (no prefix caching,
# one request at a time), each sent the same three requests with curl:
#  - a chat completion at temperature 0 with logprobs + top_logprobs 2: identical token sequences pass; a divergence
#    passes only at a near tie (the CPU's top-1/top-2 logprob margin < TIE_TOL = 1e-3 at the first differing token, the
#    other backend's token being the CPU's top-2 there); nothing after it is compared (chat_decide has the reasoning);
#  - a streamed text completion at temperature 0 (no logprobs: the on-device sampler's greedy path on cuda);
#  - a seeded sampled completion (temperature/top-k/top-p/min-p; on cuda the on-device sampler with the host's uniforms).
#  - a ~1 200-token prompt at temperature 0 (non-streamed, usage read back): both servers run their default per-step
#    token budget (cpu 512: three prefill chunks; cuda 2048: one), so this also checks the chunked CPU prefill against
#    the one-chunk CUDA prefill; the engine-step counts must differ by exactly the chunk counts' difference, and each
#    server's log must name its default budget.
# The last three must be non-empty and identical. Controls: chat_decide must fail a divergence at a decided position and
# pass one at a 1e-5 tie; a perturbed answer must compare unequal; --backend gpu must be refused by name.
# Needs curl and python3 (the GPU image has both, not node).
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
  "$PERIGEE" serve --backend "$1" --model "$MODEL" --host 127.0.0.1 --port "$2" --max-num-seqs 2 --max-model-len 2048 \
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

chat() {   # port -> {content, reasoning, usage, tokens: [bytes], lp: [logprob], top: [[token bytes, logprob] x2]}
  curl -sf -m 300 "http://127.0.0.1:$1/v1/chat/completions" -H 'Content-Type: application/json' -d "{
      \"messages\": [{\"role\": \"user\", \"content\": \"Speak of the king and the crown.\"}],
      \"temperature\": 0, \"max_tokens\": $MAX_TOKENS, \"logprobs\": true, \"top_logprobs\": 2}" |
    python3 -c '
import json, sys
r = json.load(sys.stdin); c = r["choices"][0]; m = c["message"]
lps = (c.get("logprobs") or {}).get("content") or []
print(json.dumps({"content": m.get("content") or "", "reasoning": m.get("reasoning_content") or "",
                  "usage": [r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]],
                  "tokens": [e["bytes"] for e in lps], "lp": [e["logprob"] for e in lps],
                  "top": [[[t["bytes"], t["logprob"]] for t in e["top_logprobs"]] for e in lps]}))'
}

# Decides a chat divergence: identical token sequences pass; otherwise the first differing position must be a near tie
# on the CPU (top-1 minus top-2 logprob < TIE_TOL) with the other backend's token = the CPU's top-2 there; nothing after
# it is compared (the continuations legitimately differ). Before it the logprobs must agree within LP_TOL.
# TIE_TOL 1e-3: the measured CPU-vs-CUDA logprob agreement is 1.03e-05 (test-runtime-cuda), so a top-1/top-2 margin moves
# by at most ~2e-5 between backends; 1e-3 is 50x that, and far below the margins of ordinary decisions (0.1 and up).
chat_decide() {   # cpu.json other.json -> PASS/FAIL line, rc
  python3 - "$1" "$2" "${TIE_TOL:-1e-3}" "${LP_TOL:-1e-3}" <<'EOF'
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:3])
tie_tol, lp_tol = float(sys.argv[3]), float(sys.argv[4])
ta, tb = a["tokens"], b["tokens"]
if not ta or not tb: sys.exit(print("FAIL chat: no logprobs entries (cpu %d, other %d)" % (len(ta), len(tb))) or 1)
if a["usage"][0] != b["usage"][0]: sys.exit(print("FAIL chat: prompt_tokens differ: %s vs %s" % (a["usage"], b["usage"])) or 1)
n = min(len(ta), len(tb))
i = next((k for k in range(n) if ta[k] != tb[k]), None)
upto = n if i is None else i
worst = max([abs(x - y) for x, y in zip(a["lp"][:upto], b["lp"][:upto])] or [0.0])
if worst > lp_tol: sys.exit(print("FAIL chat: sampled-token logprobs differ by %.3g (> %g) before any divergence" % (worst, lp_tol)) or 1)
if i is None:
    if len(ta) != len(tb): sys.exit(print("FAIL chat: one answer is a prefix of the other (%d vs %d tokens)" % (len(ta), len(tb))) or 1)
    if a["content"] != b["content"] or a["reasoning"] != b["reasoning"]: sys.exit(print("FAIL chat: same tokens, different text") or 1)
    sys.exit(print("PASS chat: %d tokens identical, worst sampled-token |logprob diff| %.3g" % (len(ta), worst)) or 0)
top = a["top"][i]
if len(top) < 2: sys.exit(print("FAIL chat: position %d has %d top_logprobs (need 2)" % (i, len(top))) or 1)
margin = top[0][1] - top[1][1]
btop = b["top"][i]
bmargin = btop[0][1] - btop[1][1] if len(btop) >= 2 else float("nan")
where = "first difference at generated token %d of %d: cpu %r (lp %.6f), other %r; cpu top-1/top-2 margin %.3g, other's %.3g" % (
    i, n, bytes(ta[i]), a["lp"][i], bytes(tb[i]), margin, bmargin)
if margin < tie_tol and top[1][0] == tb[i] and btop and btop[0][0] == tb[i]:
    sys.exit(print("PASS chat: near tie (margin < %g): %s; worst |logprob diff| before it %.3g; nothing after it compared" % (tie_tol, where, worst)) or 0)
sys.exit(print("FAIL chat: not a near tie (tolerance %g): %s" % (tie_tol, where)) or 1)
EOF
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

sampled() {   # port -> the text of a seeded, sampled /v1/completions
  curl -sf -m 300 "http://127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' -d "{
      \"prompt\": \"KING RICHARD:\", \"temperature\": 0.8, \"top_k\": 40, \"top_p\": 0.9, \"min_p\": 0.02,
      \"seed\": 7, \"max_tokens\": $MAX_TOKENS}" |
    python3 -c 'import json,sys; print(json.dumps({"text": json.load(sys.stdin)["choices"][0]["text"]}))'
}

long() {   # port -> {text, usage} of a ~1 200-token prompt at temperature 0 (non-streamed)
  python3 -c '
import json
lines = ["ROMEO:", "But soft, what light through yonder window breaks?", "It is the east, and Juliet is the sun.",
         "Arise, fair sun, and kill the envious moon,", "Who is already sick and pale with grief."]
text = "\n".join(lines[i % len(lines)] + (" %d" % i if i % 7 == 3 else "") for i in range(150)) + "\nJULIET:\n"
print(json.dumps({"prompt": text, "temperature": 0, "max_tokens": 24}))' |
    curl -sf -m 300 "http://127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' -d @- |
    python3 -c 'import json,sys; r=json.load(sys.stdin); print(json.dumps({"text": r["choices"][0]["text"], "usage": [r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]]}))'
}

start cpu "$PORT_CPU" || exit 1
start "$SECOND" "$PORT_CUDA" || exit 1

steps() { curl -sf "http://127.0.0.1:$1/metrics" | awk '$1 == "perigee:engine_steps_total" {print $2}'; }

# 1. Chat (non-streaming) with logprobs + top_logprobs 2 at temperature 0: the host sampler on both servers (logprobs keep
# the host path), so this compares the forward passes; a divergence must be a near tie (chat_decide).
a=$(chat "$PORT_CPU"); ra=$?
b=$(chat "$PORT_CUDA"); rb=$?
printf '%s\n' "$a" >"$OUT/smoke-chat-cpu.json"
printf '%s\n' "$b" >"$OUT/smoke-chat-$SECOND.json"
echo "chat cpu : $(python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); print(json.dumps([v["content"], v["reasoning"]]))' "$OUT/smoke-chat-cpu.json" 2>/dev/null)"
echo "chat $SECOND: $(python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); print(json.dumps([v["content"], v["reasoning"]]))' "$OUT/smoke-chat-$SECOND.json" 2>/dev/null)"
if [ $ra -ne 0 ] || [ $rb -ne 0 ]; then echo "FAIL chat: request failed (cpu rc $ra, $SECOND rc $rb)"; fail=1
else
  chat_decide "$OUT/smoke-chat-cpu.json" "$OUT/smoke-chat-$SECOND.json" || fail=1
  # Same code path on both servers: serve runs without prefix caching (no cache hits anywhere), one request at a time
  # on slot 0, so both engines take the same number of steps (one prefill + one per further token).
  sa=$(steps "$PORT_CPU"); sb=$(steps "$PORT_CUDA")
  if [ -n "$sa" ] && [ "$sa" = "$sb" ]; then echo "PASS chat: same engine steps on both servers ($sa)"
  else echo "INFO chat: engine steps cpu '$sa' vs $SECOND '$sb' (differ when the answers stop at different lengths)"; fi
fi

# Diagnosis when the chat check fails on a device backend: the same prompt (rendered to ids) through compare-backends,
# node by node CPU vs CUDA over the prefill and 30 greedy decode steps (the first node out of tolerance is printed).
if [ $fail -ne 0 ] && [ "$SECOND" != cpu ]; then
  echo '{"messages": [{"role": "user", "content": "Speak of the king and the crown."}]}' >"$OUT/chat-msg.json"
  ids=$("$PERIGEE" render --model "$MODEL" --messages "$OUT/chat-msg.json" --json 2>/dev/null |
        python3 -c 'import json,sys; print(",".join(map(str, json.load(sys.stdin)["ids"])))')
  echo "DIAG chat prompt: $(echo "$ids" | tr ',' '\n' | wc -l) ids; compare-backends --decode 30 (log $OUT/chat-compare.log):"
  timeout 300 "$PERIGEE" compare-backends --model "$MODEL" --ids "$ids" --decode 30 >"$OUT/chat-compare.log" 2>&1
  echo "DIAG compare-backends rc $?"; tail -15 "$OUT/chat-compare.log" | sed 's/^/DIAG   /'
fi

# Controls for chat_decide: (a) a difference at a decided position (margin of the real answer, forced to a different
# token) must FAIL; (b) the same difference with the CPU margin set to 1e-5 and the other token the CPU's top-2 must PASS.
if [ $ra -eq 0 ]; then
  python3 - "$OUT/smoke-chat-cpu.json" "$OUT" <<'EOF'
import json, sys
a = json.load(open(sys.argv[1])); out = sys.argv[2]
j = max(range(len(a["tokens"])), key=lambda k: a["top"][k][0][1] - a["top"][k][1][1] if len(a["top"][k]) > 1 else -1)
b = json.loads(json.dumps(a)); b["tokens"][j] = a["top"][j][1][0]; b["top"][j] = [a["top"][j][1], a["top"][j][0]]
json.dump(b, open(out + "/ctl-decided.json", "w"))
t = json.loads(json.dumps(a)); t["top"][j][1][1] = t["top"][j][0][1] - 1e-5
json.dump(t, open(out + "/ctl-tie-cpu.json", "w"))
json.dump(b, open(out + "/ctl-tie-other.json", "w"))
EOF
  if ctl=$(chat_decide "$OUT/smoke-chat-cpu.json" "$OUT/ctl-decided.json"); then echo "FAIL control: a divergence at a decided position passed: $ctl"; fail=1
  else echo "PASS control: a divergence at a decided position fails ($ctl)"; fi
  if ctl=$(chat_decide "$OUT/ctl-tie-cpu.json" "$OUT/ctl-tie-other.json"); then echo "PASS control: a divergence at a 1e-5 tie passes"
  else echo "FAIL control: a divergence at a 1e-5 tie failed: $ctl"; fail=1; fi
fi

# 2. Streamed completion at temperature 0 without logprobs (on CUDA: the on-device sampler, greedy = argmax), and
# 3. a seeded sampled completion (temperature 0.8, top_k 40, top_p 0.9, min_p 0.02, seed 7: on CUDA the on-device
# sampler with the host's uniforms): identical text required.
for kind in stream sampled; do
  a=$($kind "$PORT_CPU"); ra=$?
  b=$($kind "$PORT_CUDA"); rb=$?
  printf '%s\n' "$a" >"$OUT/smoke-$kind-cpu.json"
  printf '%s\n' "$b" >"$OUT/smoke-$kind-$SECOND.json"
  echo "$kind cpu : $a"
  echo "$kind $SECOND: $b"
  if [ $ra -ne 0 ] || [ $rb -ne 0 ]; then echo "FAIL $kind: request failed (cpu rc $ra, cuda rc $rb)"; fail=1; continue; fi
  if ! python3 -c 'import json,sys; v=json.loads(sys.argv[1]); sys.exit(0 if v["text"].strip() else 1)' "$b"; then
    echo "FAIL $kind: empty answer from --backend $SECOND"; fail=1; continue
  fi
  if [ "$a" != "$b" ]; then echo "FAIL $kind: --backend $SECOND answer differs from --backend cpu"; fail=1; continue; fi
  echo "PASS $kind: non-empty, identical on cpu and $SECOND"
done

# 4. The long prompt: identical text, and the per-step budgets seen in the engine-step counts (the servers are idle
# between requests, so a request's step delta is its prefill chunks plus one step per further generated token).
# budget_named BACKEND PORT: the log of the server started as `start BACKEND PORT` names that backend's default budget
# (backend::step_tokens_default: cpu 512, cuda 2048).
budget_named() {
  local be=$1 port=$2 want; want=$([ "$1" = cpu ] && echo 512 || echo 2048)
  if grep -q -- "--max-num-batched-tokens $want (the $be backend's default)" "$OUT/serve-$be-$port.log"; then
    echo "PASS budget: serve --backend $be (port $port) runs the default budget $want"
  else echo "FAIL budget: serve --backend $be (port $port) log does not name the default budget $want"; fail=1; fi
}
budget_named cpu "$PORT_CPU"
budget_named "$SECOND" "$PORT_CUDA"
sa0=$(steps "$PORT_CPU"); sb0=$(steps "$PORT_CUDA")
a=$(long "$PORT_CPU"); ra=$?
b=$(long "$PORT_CUDA"); rb=$?
sa1=$(steps "$PORT_CPU"); sb1=$(steps "$PORT_CUDA")
printf '%s\n' "$a" >"$OUT/smoke-long-cpu.json"
printf '%s\n' "$b" >"$OUT/smoke-long-$SECOND.json"
echo "long cpu : $a"
echo "long $SECOND: $b"
if [ $ra -ne 0 ] || [ $rb -ne 0 ]; then echo "FAIL long: request failed (cpu rc $ra, $SECOND rc $rb)"; fail=1
elif [ "$a" != "$b" ]; then echo "FAIL long: --backend $SECOND answer differs from --backend cpu"; fail=1
else
  n=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["usage"][0])' "$a")
  g=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["usage"][1])' "$a")
  want_cpu=$(( (n + 511) / 512 + g - 1 )); want_other=$(( (n + 2047) / 2048 + g - 1 ))
  [ "$SECOND" = cpu ] && want_other=$want_cpu
  if [ "$n" -gt 1024 ] && [ $(( sa1 - sa0 )) -eq $want_cpu ] && [ $(( sb1 - sb0 )) -eq $want_other ]; then
    echo "PASS long: $n prompt tokens, $g generated, identical; engine steps cpu $(( sa1 - sa0 )), $SECOND $(( sb1 - sb0 ))"
  else
    echo "FAIL long: $n prompt tokens (need > 1024), $g generated; engine steps cpu $(( sa1 - sa0 )) (want $want_cpu), $SECOND $(( sb1 - sb0 )) (want $want_other)"; fail=1
  fi
fi

# Control: the comparison must notice a different answer (a perturbed copy of the cuda answer).
if [ "$(printf '%s' "$b" | sed 's/.$/X/')" != "$b" ]; then echo "PASS control: a perturbed answer compares unequal"; else echo "FAIL control"; fail=1; fi

# Strict backend names: an unknown one is an error naming it.
if "$PERIGEE" generate --backend gpu --model "$MODEL" --ids 1,2,3 -n 1 >"$OUT/bad-backend.log" 2>&1; then
  echo "FAIL --backend gpu was accepted"; fail=1
elif grep -q "'gpu'" "$OUT/bad-backend.log"; then echo "PASS --backend gpu refused: $(grep -o "unknown backend.*" "$OUT/bad-backend.log" | head -1)"
else echo "FAIL --backend gpu refused without naming it: $(tail -1 "$OUT/bad-backend.log")"; fail=1; fi

if [ $fail -eq 0 ]; then echo "serve-smoke: PASS"; else echo "serve-smoke: FAIL"; fi
exit $fail
