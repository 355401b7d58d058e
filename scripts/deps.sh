#!/usr/bin/env bash
# Installs the Debian packages gkv needs to build, test and run, skipping what is present.
# Safe to run repeatedly. Needs root (or sudo) when something is missing.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  libucx-dev ucx-utils librocksdb-dev libxxhash-dev libfmt-dev libspdlog-dev
  libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev libyaml-cpp-dev libcpp-httplib-dev
  clang-14 libclang-rt-14-dev python3
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
echo "gkv: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
