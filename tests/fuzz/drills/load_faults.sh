#!/usr/bin/env bash
# Fault drill (issue 9 item 4; RELIABILITY.md §B1 L-01/L-03/L-05/L-08, §B2 L-31, contract OK-load-fail):
# a damaged checkpoint discovered at load must give one clear error naming the shard, a non-zero exit, no
# logits on stdout (nothing half-loaded is used), no crash/abort/sanitizer report, within 5 s and without
# an allocation sized by the damaged number (peak RSS <= the good run's + 64 MiB).
# Control: the undamaged tree loads and prints logits, and a damaged tree's check must fail on a good tree.
# usage: load_faults.sh PERIGEE_BINARY WORK_DIR
set -u
P="$1"
D="$2"
rm -rf "$D"
mkdir -p "$D"
"$P" synth --preset k3-tiny --out "$D/good" --seed 5 >/dev/null || { echo "FAIL: synth"; exit 1; }
IDS=3,1,4,1,5
FAILS=0

run() {  # run DIR -> sets RC, OUT, ERR, RSS_KB, SECS
  local t0 t1
  t0=$(date +%s%N)
  /usr/bin/time -f '%M' -o "$D/rss" "$P" logits --model "$1" --ids $IDS >"$D/out" 2>"$D/err"
  RC=$?
  t1=$(date +%s%N)
  SECS=$(( (t1 - t0) / 1000000 ))
  RSS_KB=$(tail -1 "$D/rss")
}

run "$D/good"
if [ "$RC" != 0 ] || ! grep -q '[0-9]' "$D/out"; then echo "FAIL: control: the good tree did not load (rc $RC)"; cat "$D/err"; exit 1; fi
GOOD_RSS=$RSS_KB
echo "ok: control: good tree loads (rc 0, ${SECS} ms, peak RSS ${GOOD_RSS} KiB)"

SHARD=model-00002-of-00003.safetensors
[ -f "$D/good/$SHARD" ] || { echo "FAIL: synth layout changed: no $SHARD"; exit 1; }

# drill NAME EXPECT_IN_ERROR MUTATION (a shell snippet run with $F = the shard in a fresh copy)
drill() {
  local name=$1 expect=$2 mutation=$3
  rm -rf "$D/bad"; cp -r "$D/good" "$D/bad"
  F="$D/bad/$SHARD" IDX="$D/bad/model.safetensors.index.json" bash -c "$mutation"
  run "$D/bad"
  local why=""
  [ "$RC" = 0 ] && why="exit 0"
  [ "$RC" -ge 128 ] && why="killed by signal $((RC - 128))"
  [ -s "$D/out" ] && why="$why; printed logits"
  grep -qE 'terminate called|Aborted|AddressSanitizer|runtime error|LeakSanitizer|Segmentation' "$D/err" && why="$why; crash/sanitizer text"
  grep -q -- "$expect" "$D/err" || why="$why; error does not name '$expect'"
  [ "$(wc -l < "$D/err")" -le 3 ] || why="$why; $(wc -l < "$D/err") lines of stderr"
  [ "$SECS" -le 5000 ] || why="$why; took ${SECS} ms"
  [ "$RSS_KB" -le $((GOOD_RSS + 65536)) ] || why="$why; peak RSS ${RSS_KB} KiB (good run ${GOOD_RSS})"
  if [ -n "$why" ]; then
    echo "FAIL: $name: ${why#; } (rc $RC)"; sed 's/^/    /' "$D/err" | head -5; FAILS=$((FAILS + 1))
  else
    echo "ok: $name: rc $RC, ${SECS} ms: $(head -1 "$D/err" | cut -c1-160)"
  fi
}

drill "truncated shard (last 100 bytes cut)" "$SHARD" 'truncate -s -100 "$F"'
drill "truncated shard (inside the header)" "$SHARD" 'truncate -s 100 "$F"'
drill "shard of 0 bytes" "$SHARD" 'truncate -s 0 "$F"'
drill "shard of 5 bytes" "$SHARD" 'truncate -s 5 "$F"'
drill "header length 2^63" "$SHARD" 'printf "\x00\x00\x00\x00\x00\x00\x00\x80" | dd of="$F" bs=1 seek=0 conv=notrunc status=none'
drill "header length past the file" "$SHARD" 'printf "\x00\x00\x00\x10\x00\x00\x00\x00" | dd of="$F" bs=1 seek=0 conv=notrunc status=none'
drill "corrupted header JSON (first byte)" "$SHARD" 'printf "[" | dd of="$F" bs=1 seek=8 conv=notrunc status=none'
drill "corrupted header JSON (quote in the middle)" "$SHARD" 'printf "\x01" | dd of="$F" bs=1 seek=60 conv=notrunc status=none'
drill "header not UTF-8" "$SHARD" 'printf "\xff" | dd of="$F" bs=1 seek=12 conv=notrunc status=none'
drill "extra bytes after the last tensor" "$SHARD" 'printf "junk" >> "$F"'
drill "shard missing" "$SHARD" 'rm "$F"'
drill "index names a shard outside the directory" "../" 'sed -i "0,/model-00002-of-00003/s//..\/model-00002-of-00003/" "$IDX"'

# Control for the checker itself: a "drill" that damages nothing must be reported as a failure.
before=$FAILS
drill "control: no damage (must FAIL)" "$SHARD" 'true' >/dev/null
if [ "$FAILS" = "$before" ]; then echo "FAIL: control: an undamaged tree passed as a failed load"; FAILS=$((FAILS + 1)); else FAILS=$before; echo "ok: control: an undamaged tree is not mistaken for a failed load"; fi

[ "$FAILS" = 0 ] && echo "load fault drills: all passed" || echo "load fault drills: $FAILS failed"
exit $(( FAILS > 0 ))
