# Shared by the session call scripts: unpack the carried binaries and libraries, set the paths, and the helpers
# run (a test binary under a timeout, its pass/fail line into the summary) and san (the same under compute-sanitizer).
mkdir -p .gpu-carry-r1 && tar xJf .gpu-pack/carry.tar.xz -C .gpu-carry-r1
export LD_LIBRARY_PATH=$PWD/.gpu-carry-r1/lib:/usr/local/cuda/lib64
B=$PWD/.gpu-carry-r1/bin; L=$OUT/logs; mkdir -p $L; S=$OUT/summary.txt; T0=$(date +%s)
run() { local t=$1 to=$2 suf=$3; shift 3; local s=$(date +%s); timeout $to $B/$t "$@" > $L/$t$suf.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $t$suf rc=$rc $(( $(date +%s) - s ))s | $(grep -E 'passed, .* failed|PASSED|FAILED' $L/$t$suf.log | tail -3 | tr '\n' ' ')" >> $S; }
