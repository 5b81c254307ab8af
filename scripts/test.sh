#!/usr/bin/env bash
# Set up, build, and run the whole test suite through ctest (formatting included).
#   scripts/test.sh          # release build in build/
#   scripts/test.sh asan     # AddressSanitizer + UBSan build in build-asan/
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-release}
scripts/setup.sh
scripts/build.sh "$preset" -DTPX_WERROR=ON  # warnings (g++ and nvcc) fail the build
source scripts/env.sh
ctest --preset "$preset"
