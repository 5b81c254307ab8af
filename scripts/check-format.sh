#!/usr/bin/env bash
# Fails (listing the files) if any C++/CUDA source differs from what .clang-format produces.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(find common tools tests bench 0[1-9]_* -type f \
  \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) 2>/dev/null | sort)
bad=()
for f in "${files[@]}"; do
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -ne 0 ]; then
  echo "not clang-formatted (run: clang-format -i <file>):"
  printf '  %s\n' "${bad[@]}"
  exit 1
fi
echo "clang-format: ${#files[@]} files clean"
