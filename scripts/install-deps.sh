#!/usr/bin/env bash
# Installs what Perigee needs to build and test on Debian 12 (bookworm).
# Idempotent: a second run only checks. Runs as root (CI and the dev machines are root);
# otherwise uses sudo.
set -euo pipefail
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo

pkgs=(
  build-essential cmake ninja-build ccache pkg-config
  nlohmann-json3-dev libpcre2-dev libcli11-dev libfmt-dev libspdlog-dev
  libcpp-httplib-dev libxxhash-dev libutfcpp-dev libedit-dev
  libgtest-dev libgmock-dev
  python3-numpy
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: all ${#pkgs[@]} packages present"
fi
