#!/usr/bin/env bash
# Builds the wire-protocol libFuzzer target with clang (ASan+UBSan+libFuzzer) and runs it for a
# bounded time over the checked-in corpus (tests/fuzz/corpus, copied so the run does not modify
# the repository). Any crash fails the script and leaves the reproducer in build-fuzz/.
#   scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-30}
CXX=${FUZZ_CXX:-$(command -v clang++-14 || command -v clang++)}
mkdir -p build-fuzz
"$CXX" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -Icommon/include -Itransport/include \
  tests/fuzz/protocol_fuzzer.cc transport/src/protocol.cc common/src/tensor.cc common/src/status.cc \
  -o build-fuzz/protocol_fuzzer
rm -rf build-fuzz/corpus && cp -r tests/fuzz/corpus build-fuzz/corpus
cd build-fuzz
./protocol_fuzzer -max_total_time="$SECS" -max_len=4096 -print_final_stats=1 corpus 2>&1 |
  tail -n 12
