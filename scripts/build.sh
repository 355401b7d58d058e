#!/usr/bin/env bash
# Configures and builds gkv into build/ (or $GKV_BUILD_DIR) with Ninja. Extra arguments go to
# cmake, e.g. scripts/build.sh -DGKV_SANITIZE=address.
set -euo pipefail
cd "$(dirname "$0")/.."
"$PWD/scripts/deps.sh"
BUILD_DIR=${GKV_BUILD_DIR:-build}
mkdir -p "$BUILD_DIR"
# GKV_UCX_PREFIX: a site's UCX (>= 1.16) instead of the libucx-cu13 wheel in .venv/.
ucx_args=()
if [ -n "${GKV_UCX_PREFIX:-}" ]; then ucx_args=("-DGKV_UCX_PREFIX=$GKV_UCX_PREFIX"); fi
cmake -S . -B "$BUILD_DIR" -G Ninja "${ucx_args[@]}" "$@" > "$BUILD_DIR/configure.log" 2>&1 || {
  cat "$BUILD_DIR/configure.log"
  exit 1
}
grep -E "^-- gkv:" "$BUILD_DIR/configure.log" || true
# GKV_TARGETS limits the build to some targets (the TSan step needs only the concurrency tests).
# shellcheck disable=SC2086
ninja -C "$BUILD_DIR" -j "${GKV_JOBS:-$(nproc)}" ${GKV_TARGETS:-}
