#!/usr/bin/env bash
# Installs the Debian packages tpx needs. Idempotent: does nothing when they are all present.
# As a non-root user without them it prints the exact command to run and exits non-zero.
set -euo pipefail

packages=(
  build-essential cmake ninja-build git pkg-config
  openmpi-bin libopenmpi-dev        # MPI: collectives, P2P and shared-memory windows
  libopenblas-dev                   # CBLAS GEMMs of the cpu backend
  libcli11-dev libfmt-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  doxygen clang-format
  doxygen-awesome-css libjs-mathjax # the tutorial site's theme and its formulas (docs target)
  chromium chromium-driver python3-selenium cmark-gfm  # its tests: in a browser, and as GitHub renders it
  python3                           # tools/trace_svg.py, scripts/check-quotes.py
  python3-matplotlib                # tools/bench.py's plots (scripts/bench.sh)
  bible-kjv bible-kjv-text          # the language model's text: the King James Version (scripts/make-corpus.sh)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

cmd="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "setup: missing packages: ${missing[*]}" >&2
  echo "setup: run as root:  sudo sh -c '$cmd'" >&2
  exit 1
fi
echo "setup: installing ${missing[*]}"
sh -c "$cmd"
