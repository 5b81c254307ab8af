#!/usr/bin/env bash
# Set up, build, and run the whole test suite through ctest (formatting included).
#   scripts/test.sh          # release build in build/ (CUDA too where nvcc is found), then the
#                            # cpu-only build in build-cpu/ and its stage-01 tests
#   scripts/test.sh asan     # AddressSanitizer + UBSan build in build-asan/
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-release}
scripts/setup.sh --transformers --nvdisasm  # and PyPI tools: transformers (tests/lm_transformers.py), nvdisasm (flash_sass)
scripts/build.sh "$preset" -DTPX_WERROR=ON  # warnings (g++ and nvcc) fail the build
source scripts/env.sh
ctest --preset "$preset"
if [ "$preset" = release ]; then
  # A machine without the CUDA toolkit builds only the cpu backend: the #if !TPX_WITH_CUDA side of
  # every file must build warning-free too, and stage 01 (which says --device cuda cannot run in
  # such a build) must pass its tests there (all but the measured-peak sweep, label memory: the
  # same cpu allocator and estimate the release build's run already checks).
  scripts/build.sh cpu -DTPX_WERROR=ON
  ctest --preset cpu
fi
