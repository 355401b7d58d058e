#!/usr/bin/env bash
# Starts or stops a local gkv cluster on loopback (used by the demo and the comparisons).
#   scripts/cluster.sh start DIR N [gkv-server options...]   writes DIR/cluster.yaml, DIR/pids
#   scripts/cluster.sh stop DIR                              SIGTERM by process id, then waits
# Ports are free ones picked by the kernel. Logs: DIR/nodeI.log. Disk tiers: DIR/diskI.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
cmd=${1:-}
dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { echo "usage: $0 start DIR N [opts] | stop DIR" >&2; exit 2; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

case "$cmd" in
  start)
    n=${3:-3}
    shift 3 || true
    mkdir -p "$dir"
    echo "nodes:" > "$dir/cluster.yaml"
    for i in $(seq 0 $((n - 1))); do
      echo "  - {id: n$i, address: 127.0.0.1:$(free_port)}" >> "$dir/cluster.yaml"
    done
    : > "$dir/pids"
    for i in $(seq 0 $((n - 1))); do
      "$ROOT/build/bin/gkv-server" --cluster "$dir/cluster.yaml" --node "n$i" \
        --disk "$dir/disk$i" "$@" > "$dir/node$i.log" 2>&1 &
      echo $! >> "$dir/pids"
    done
    # Ready when every node logged that it is up (or fail with its log).
    for i in $(seq 0 $((n - 1))); do
      for _ in $(seq 1 100); do
        grep -q "node n$i up" "$dir/node$i.log" 2>/dev/null && break
        if ! kill -0 "$(sed -n "$((i + 1))p" "$dir/pids")" 2>/dev/null; then
          echo "node n$i failed to start:" >&2; cat "$dir/node$i.log" >&2; exit 1
        fi
        sleep 0.1
      done
      grep -q "node n$i up" "$dir/node$i.log" || { echo "node n$i did not come up" >&2; exit 1; }
    done
    echo "cluster of $n nodes up: $dir/cluster.yaml"
    ;;
  stop)
    [ -f "$dir/pids" ] || exit 0
    while read -r pid; do kill -TERM "$pid" 2>/dev/null || true; done < "$dir/pids"
    while read -r pid; do
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null || true
    done < "$dir/pids"
    rm -f "$dir/pids"
    ;;
  *) echo "usage: $0 start DIR N [opts] | stop DIR" >&2; exit 2 ;;
esac
