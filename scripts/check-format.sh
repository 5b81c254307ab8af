#!/usr/bin/env bash
# Fails (listing the files) if any C++/CUDA source differs from what .clang-format produces.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(find common tools tests bench 0[1-9]_* [1-9][0-9]_* -type f \
  \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) 2>/dev/null | sort)
# One clang-format for every file (it goes on past a file that differs, naming each difference
# "FILE:LINE:COL: error: code should be clang-formatted").
status=0
report=$(clang-format --dry-run -Werror "${files[@]}" 2>&1) || status=$?
mapfile -t bad < <(sed -nE 's/^(.+):[0-9]+:[0-9]+: error: code should be clang-formatted.*/\1/p' \
  <<<"$report" | sort -u)
if [ ${#bad[@]} -ne 0 ]; then
  echo "not clang-formatted (run: clang-format -i <file>):"
  printf '  %s\n' "${bad[@]}"
  exit 1
fi
if [ $status -ne 0 ]; then  # failed for another reason (a file it cannot read, a bad style file)
  echo "clang-format failed:"
  head -20 <<<"$report"
  exit 1
fi
echo "clang-format: ${#files[@]} files clean"
