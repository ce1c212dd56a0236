#!/usr/bin/env bash
# ctest entry: the openai-client end-to-end tests (skips with 77 when the npm deps are missing).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ ! -f "$here/node_modules/openai/package.json" ]; then
  echo "SKIP: the openai npm client is not installed (run scripts/install-server-test-deps.sh)"
  exit 77
fi
if ! command -v node >/dev/null 2>&1; then echo "SKIP: node not found"; exit 77; fi
exec node --test --test-concurrency=1 "$here/test_openai.mjs"
