#!/usr/bin/env bash
# Runs one of UCX's own tools (ucx_info, ucx_perftest, ...) from the UCX that gkv links: the
# prefix recorded in build/ (GKV_UCX_PREFIX), else the libucx-cu13 wheel in .venv/. The wheel's
# tools do not find their libraries by themselves, hence this wrapper.
#   scripts/ucx.sh ucx_info -v
#   scripts/ucx.sh ucx_perftest -t ucp_am_bw ...
# UCX_TOOL_WRAPPER: a command (split on spaces) that runs the tool, e.g. "valgrind --tool=callgrind".
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
prefix=${GKV_UCX_PREFIX:-}
if [ -z "$prefix" ] && [ -f "$root/build/CMakeCache.txt" ]; then
  prefix=$(sed -n 's/^GKV_UCX_PREFIX:PATH=//p' "$root/build/CMakeCache.txt")
fi
if [ -z "$prefix" ]; then prefix=$(ls -d "$root"/.venv/lib/python3*/site-packages/libucx 2>/dev/null | head -n1); fi
if [ -z "$prefix" ] || [ ! -x "$prefix/bin/$1" ]; then
  echo "scripts/ucx.sh: no UCX tool '$1' (run scripts/deps.sh, or set GKV_UCX_PREFIX)" >&2
  exit 2
fi
tool=$1
shift
read -r -a wrapper <<< "${UCX_TOOL_WRAPPER:-}"
LD_LIBRARY_PATH="$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "${wrapper[@]}" \
  "$prefix/bin/$tool" "$@"
