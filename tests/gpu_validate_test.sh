#!/usr/bin/env bash
# scripts/gpu-validate.sh without a GPU, and its report, on any machine: a stand-in nvidia-smi
# first lists no GPU (the script must stop at once, exit 2, one line), then one GPU (the "facts"
# part must run, write report.md with its table and end with "N passed, N failed").
#
#   tests/gpu_validate_test.sh <build dir>
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() {
  echo "FAIL: $*"
  exit 1
}

mkdir "$tmp/none" "$tmp/one"
printf '#!/bin/sh\nexit 9\n' >"$tmp/none/nvidia-smi"
printf '#!/bin/sh\necho "GPU 0: Stand-in GPU (UUID: GPU-0)"\n' >"$tmp/one/nvidia-smi"
chmod +x "$tmp/none/nvidia-smi" "$tmp/one/nvidia-smi"

start=$SECONDS
text=$(PATH="$tmp/none:$PATH" TPX_BUILD="$build" "$root/scripts/gpu-validate.sh" "$tmp/out0" 2>&1)
rc=$?
[ $rc -eq 2 ] || fail "no GPU: exit $rc, expected 2"
[ "$(wc -l <<<"$text")" -eq 1 ] || fail "no GPU: expected one line, got: $text"
grep -q "no GPU is visible" <<<"$text" || fail "no GPU: the line does not say so: $text"
[ $((SECONDS - start)) -lt 10 ] || fail "no GPU: took $((SECONDS - start)) s"

PATH="$tmp/one:$PATH" TPX_BUILD="$build" "$root/scripts/gpu-validate.sh" "$tmp/out1" facts \
  >"$tmp/facts.txt" 2>&1
report=$tmp/out1/report.md
[ -f "$report" ] || fail "no report.md: $(cat "$tmp/facts.txt")"
grep -q "^| # | step | result | seconds | command | log |" "$report" || fail "no step table"
[ "$(grep -c '^| [0-9]' "$report")" -eq 3 ] || fail "expected 3 steps in: $(cat "$report")"
tail -1 "$report" | grep -Eq '^[0-9]+ passed, [0-9]+ failed$' || fail "last line: $(tail -1 "$report")"
[ "$(find "$tmp/out1/logs" -type f | wc -l)" -eq 3 ] || fail "expected 3 logs"
[ "$(tar -tzf "$tmp/out1/logs.tar.gz" | grep -c '\.log$')" -eq 3 ] || fail "expected 3 logs in the tar"
PATH="$tmp/one:$PATH" "$root/scripts/gpu-validate.sh" "$tmp/out2" nonsense >/dev/null 2>&1
[ $? -eq 2 ] || fail "an unknown part must be an error"
echo "gpu-validate: refuses without a GPU in one line; writes its report with a GPU"
