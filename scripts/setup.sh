#!/usr/bin/env bash
# Installs the Debian packages tpx needs; with --transformers (scripts/test.sh) also Hugging Face
# transformers from PyPI into .venv-hf, for tests/lm_transformers.py, and with --nvdisasm (also
# scripts/test.sh) NVIDIA's SASS disassembler from PyPI into .venv-nvdisasm where nvcc is found,
# for the ctest flash_sass (the toolkit's own packages here ship neither it nor cuobjdump).
# Idempotent: does nothing when they are all present. As a non-root user without the packages it prints the exact command
# to run and exits non-zero. TPX_NO_TRANSFORMERS=1 leaves transformers out (offline); the test
# then reports itself skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
transformers=0
nvdisasm=0
for arg in "$@"; do
  case "$arg" in
    --transformers) transformers=1 ;;
    --nvdisasm) nvdisasm=1 ;;
    *) echo "setup: unknown argument $arg (known: --transformers, --nvdisasm)" >&2; exit 2 ;;
  esac
done

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
  python3-torch python3-venv python3-packaging  # tests/lm_transformers.py (PyTorch on the cpu)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
else
  cmd="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing packages: ${missing[*]}" >&2
    echo "setup: run as root:  sudo sh -c '$cmd'" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  sh -c "$cmd"
fi

# transformers from PyPI at the versions pinned in the requirements file, in a virtual environment
# that sees Debian's python3-torch (PyPI's torch wheels pull gigabytes of CUDA libraries). The
# environment keeps a copy of the file it was made from: the same file, nothing to do.
install_transformers() {
  local venv=.venv-hf req=scripts/requirements-transformers.txt
  if [ "${TPX_NO_TRANSFORMERS:-0}" = 1 ]; then
    echo "setup: TPX_NO_TRANSFORMERS=1: no transformers (tests/lm_transformers.py skips)"
  elif cmp -s "$req" "$venv/requirements.txt"; then
    echo "setup: transformers present ($venv)"
  else
    echo "setup: installing transformers into $venv ($req)"
    rm -rf "$venv"
    /usr/bin/python3 -m venv --system-site-packages "$venv"
    if ! "$venv/bin/pip" install --disable-pip-version-check --no-input --quiet --only-binary :all: \
        -r "$req"; then
      echo "setup: pip could not install $req (offline? TPX_NO_TRANSFORMERS=1 leaves it out)" >&2
      exit 1
    fi
    "$venv/bin/python" -c 'import torch, transformers'
    cp "$req" "$venv/requirements.txt"
  fi
}
[ "$transformers" = 1 ] && install_transformers

# nvdisasm from PyPI (a wheel that holds the binary alone), pinned in its requirements file, in a
# virtual environment of its own; only where nvcc is found (a CUDA build makes the cubin it reads).
# Offline, or with TPX_NO_NVDISASM=1, the ctest flash_sass reports itself skipped.
install_nvdisasm() {
  local venv=.venv-nvdisasm req=scripts/requirements-nvdisasm.txt
  if [ "${TPX_NO_NVDISASM:-0}" = 1 ]; then
    echo "setup: TPX_NO_NVDISASM=1: no nvdisasm (the ctest flash_sass skips)"
  elif ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "setup: no nvcc: no nvdisasm (nothing to disassemble)"
  elif cmp -s "$req" "$venv/requirements.txt"; then
    echo "setup: nvdisasm present ($venv)"
  else
    echo "setup: installing nvdisasm into $venv ($req)"
    rm -rf "$venv"
    /usr/bin/python3 -m venv "$venv"
    if ! "$venv/bin/pip" install --disable-pip-version-check --no-input --quiet --only-binary :all: \
        -r "$req"; then
      echo "setup: pip could not install $req (offline? TPX_NO_NVDISASM=1 leaves it out)" >&2
      exit 1
    fi
    cp "$req" "$venv/requirements.txt"
  fi
}
[ "$nvdisasm" = 1 ] && install_nvdisasm
exit 0
