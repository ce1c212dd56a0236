#!/usr/bin/env bash
# Installs what the server end-to-end tests need beyond scripts/install-deps.sh:
#  * the npm dependencies (the official `openai` client, pinned in tests/e2e-server/package.json /
#    package-lock.json) into tests/e2e-server/node_modules (gitignored); needs node >= 18 and npm
#    (Debian: nodejs npm);
#  * Debian chromium + chromium-driver for the web page test (tests/unit/server/test_webui_chromium.cpp;
#    skipped when absent). Needs root for apt-get; skip with PERIGEE_NO_CHROMIUM=1.
# Idempotent.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

if [ "${PERIGEE_NO_CHROMIUM:-0}" != "1" ]; then
  if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-dejavu-core
  fi
  echo "install-server-test-deps: $(chromium --version 2>/dev/null || echo 'chromium missing'); $(chromedriver --version 2>/dev/null | head -1 || echo 'chromedriver missing')"
fi

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
