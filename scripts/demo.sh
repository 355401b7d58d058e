#!/usr/bin/env bash
# The demo: installs what is missing, builds, and shows a node cache at work.
# (Until the cluster server lands, this runs the node cache's own benchmark: puts into each tier,
# spills from host memory to RocksDB, promotions back, with memcpy as the ceiling.)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
build/bin/gkv-storage-bench \
  --benchmark_filter='Memcpy/1048576|PutHostTier/1048576|GetHostTier/1048576|GetDiskTier/1048576|SpillHostToDisk/1048576|PromoteDiskToHost/1048576|IndexOverhead' \
  --benchmark_min_time=0.2
