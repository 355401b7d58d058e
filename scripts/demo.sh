#!/usr/bin/env bash
# The demo: installs what is missing, builds, starts a 3-node gkv cluster on loopback with memory
# small enough that the disk tier is used, runs the embeddings training workload for about a
# minute with validation on, prints the report, and stops the nodes by process id.
#   GKV_DEMO_SECONDS=20 ./scripts/demo.sh    a shorter run
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
DIR=$(mktemp -d /tmp/gkv-demo-XXXXXX)
cleanup() {
  scripts/cluster.sh stop "$DIR" || true
  rm -rf "$DIR"
}
trap cleanup EXIT
# 3 nodes x 48 MiB of host memory for ~240 MiB of embedding rows: the cold tail lives on disk.
scripts/cluster.sh start "$DIR" 3 --host-mem 48MiB --disk-capacity 4GiB --threads 2
SECONDS_TO_RUN=${GKV_DEMO_SECONDS:-50}
build/bin/gkv-bench --cluster "$DIR/cluster.yaml" --workload embeddings --keys 500000 \
  --duration "$SECONDS_TO_RUN" --warmup 5 --validate --json "$DIR/report.json"
