#!/usr/bin/env bash
# Installs the npm dependencies of the server end-to-end tests (the official `openai` client,
# pinned in tests/e2e-server/package.json / package-lock.json) into tests/e2e-server/node_modules
# (gitignored). Idempotent. Needs node >= 18 and npm (Debian: nodejs npm).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root/tests/e2e-server"
if ! command -v npm >/dev/null 2>&1; then
  echo "install-server-test-deps: npm not found (apt-get install nodejs npm)" >&2
  exit 1
fi
if [ -f package-lock.json ]; then
  npm ci --no-audit --no-fund --loglevel=error
else
  npm install --no-audit --no-fund --loglevel=error
fi
node -e 'require("./node_modules/openai/package.json").version' >/dev/null
echo "install-server-test-deps: openai $(node -p 'require("./node_modules/openai/package.json").version') in tests/e2e-server/node_modules"
