#!/usr/bin/env bash
# Configures and builds a CMake preset (default: release, into build/); further arguments go to
# the configure step, e.g. scripts/build.sh release -DTPX_CUDA=OFF.
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-release}
shift || true
cmake --preset "$preset" "$@" >/dev/null
cmake --build --preset "$preset" -j "$(nproc)"
