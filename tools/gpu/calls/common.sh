# Shared by the session call scripts: unpack the carried binaries and libraries, set the paths, and the helpers
# run (a test binary under a timeout, its pass/fail line into the summary) and san (the same under compute-sanitizer).
mkdir -p .gpu-carry-r1 && tar xJf .gpu-pack/carry.tar.xz -C .gpu-carry-r1
export LD_LIBRARY_PATH=$PWD/.gpu-carry-r1/lib:/usr/local/cuda/lib64
B=$PWD/.gpu-carry-r1/bin; L=$OUT/logs; mkdir -p $L; S=$OUT/summary.txt; T0=$(date +%s)
run() { local t=$1 to=$2 suf=$3; shift 3; local s=$(date +%s); timeout $to $B/$t "$@" > $L/$t$suf.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $t$suf rc=$rc $(( $(date +%s) - s ))s | $(grep -E 'passed, .* failed|PASSED|FAILED' $L/$t$suf.log | tail -3 | tr '\n' ' ')" >> $S; }
# san TOOL BINARY FILTER TIMEOUT: the binary's gtest filter under compute-sanitizer (memcheck, racecheck, ...), its
# summary line into the summary. (Session scripts up to session 9 define their own copy; later ones use this.)
# (rc is taken right after the command: inside the echo, $? would be the status of the $(date) expansions before it.
# The scripts that ran before session 11's fix, and their own echo rows written that way, logged rc=0 on those rows
# whatever the outcome; their test rows, from run(), were right, and the sanitizer rows carry the tool's summary line.)
san() { local tool=$1 t=$2 f=$3 to=$4; local s=$(date +%s); timeout $to /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 $B/$t --gtest_filter="$f" > $L/$tool-$t.log 2>&1
  local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $tool $t ($f) rc=$rc $(( $(date +%s) - s ))s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY' $L/$tool-$t.log | tail -1)" >> $S; }
# compare_models [N DECODE TIMEOUT TAG ARGS...]: perigee compare-backends (an N-token prompt, DECODE decode steps; default
# 70, 6, 60 s; ARGS added to each run) on the Kimi-Linear goldens, the tiny synth models and the shipped models, one
# summary line each; the log is $L/compare.log for 70 tokens, $L/compare$N.log otherwise (300: prefill-sized steps),
# $L/compare$N-TAG.log with a TAG.
compare_models() {
  local n=${1:-70} dec=${2:-6} to=${3:-60} tag=${4:-}; shift $(( $# < 4 ? $# : 4 ))
  local log=$L/compare$([ "$n" = 70 ] && [ -z "$tag" ] || echo $n)${tag:+-$tag}.log
  local IDS=$(python3 -c "print(','.join(str((i*37+11)%250) for i in range($n)))")
  mkdir -p /tmp/pg-models; for p in k3-tiny kimi-linear-tiny k31-tiny; do [ -d /tmp/pg-models/$p ] || $B/perigee synth --preset $p --out /tmp/pg-models/$p > /dev/null 2>&1; done
  for m in tests/golden/kimi_linear/*/ /tmp/pg-models/*/ models/default models/k31-default; do
    timeout $to $B/perigee compare-backends --model "$m" --ids "$IDS" --decode $dec "$@" >> $log 2>&1; local rc=$?
    echo "[$(( $(date +%s) - T0 ))s] compare${tag:+ $tag} $m ($n ids) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $log | tail -1)" >> $S
  done; }
# b PRESET TAG [SETS]: one bench-cuda-decode run ($D: its command line, set by the calling script) with --set SETS,
# the preset's "new" rows (batch, ms, tok/s, floor share) into the summary.
b() { local p=$1 tag=$2 sets=${3:-}; $D --preset $p ${sets:+--set $sets} > $L/d-$p-$tag.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $p $tag rc=$rc | $(grep -E "^$p +new" $L/d-$p-$tag.log | awk '{print $1, $5, $6, $NF}' | tr '\n' ' ')" >> $S; }
# decode_rounds N [ARGS]: N rounds of the defaults at batches 1, 8, 64 ($D: the bench command line, set by the caller),
# each round's "new" rows (preset, B, graph ms, tok/s, floor share) into the summary.
decode_rounds() { local n=$1; shift; for round in $(seq 1 $n); do $D --batch 1,8,64 "$@" > $L/dec-$round.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] r$round defaults rc=$rc | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec-$round.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S; done; }
# prefill PRESET SIZES TAG: bench-cuda-decode --prefill on one preset with the per-op profile; the step times, the GEMM
# share and the GEMM-class roofline lines into the summary, the whole log kept under $OUT.
prefill() { local p=$1 sizes=$2 tag=$3; shift 3; timeout 300 $B/bench-cuda-decode --preset $p --prefill $sizes "$@" > $OUT/prefill-$p-$tag.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] prefill $p $tag rc=$rc | $(grep -E '(default|bf16-in) +T|GEMM share|roofline' $OUT/prefill-$p-$tag.log | tr '\n' ' ')" >> $S; }
# full_suite: every CUDA test binary (three lanes in parallel), compare-backends on the 9 models (compare_models) and the
# serve smoke CPU vs CUDA, each one summary line; the logs under $L, the serve smoke's into $OUT/smoke.
full_suite() {
  ( run test-moe-cuda 420 "" ) &
  ( run test-fuse-cuda 300 ""; run test-runtime-cuda 300 ""; run test-sample-cuda 120 ""
    run test-pdl-cuda 120 ""; run test-kda-cuda 120 ""; run test-kda-decode-cuda 120 "" ) &
  ( run test-ops-cuda 300 ""; run test-mla-cuda 200 ""; run test-prefill-cuda 200 "" ) &
  wait
  compare_models
  mkdir -p .gpu-carry/bin .gpu-carry/lib && cp $B/perigee .gpu-carry/bin/ && cp .gpu-carry-r1/lib/* .gpu-carry/lib/
  OUT=$OUT/smoke timeout 300 bash tools/gpu/serve-smoke.sh > $L/serve-smoke.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] serve-smoke rc=$rc | $(grep -E '^(PASS|FAIL)|serve-smoke:' $L/serve-smoke.log | tr '\n' ' ')" >> $S; }
# prefill_48b_if_fits: the 48B geometry's prefill (512 and 2048 tokens) under the bf16 policy and the split policy, only
# on a card with more than 100 GB (its 98 GB of weights do not fit an H100 80GB); nothing, and a summary line, otherwise.
prefill_48b_if_fits() {
  local mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "${mem:-0}" -gt 100000 ]; then
    prefill kimi-linear-48b 512,2048 bf16 --bf16-inputs 256 --no-profile
    prefill kimi-linear-48b 512,2048 split --no-profile
  else echo "[$(( $(date +%s) - T0 ))s] prefill kimi-linear-48b: skipped, ${mem:-?} MiB on this card" >> $S; fi; }
# cut_48b: CUT="" on a card with more than 100 GB, else CUT="--layers 16" (the 48B geometry's 98 GB do not fit an 80 GB
# card: its rows then run 16 of the 27 layers) and a summary line saying so. For bench-cuda-decode's 48B command lines.
cut_48b() {
  local mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "${mem:-0}" -gt 100000 ]; then CUT=""; else CUT="--layers 16"; echo "48B rows cut to 16 layers (${mem} MiB card)" >> $S; fi; }
