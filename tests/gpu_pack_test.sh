#!/usr/bin/env bash
# scripts/gpu-pack.sh packs exactly what scripts/gpu-validate.sh runs, on any machine: every part
# of gpu-validate.sh runs over a stand-in build whose bin/ holds one stand-in for each program
# `gpu-pack.sh --list` names (each records its name and prints what the steps look for), with
# stand-ins for nvidia-smi, mpirun, compute-sanitizer and ncu. The programs the steps ran must be
# the packed list: one the validation runs but the pack leaves out shows as a step "missing from
# the build"; one packed but never run is carried for nothing.
#
#   tests/gpu_pack_test.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() {
  echo "FAIL: $*"
  exit 1
}

mapfile -t packed < <("$root/scripts/gpu-pack.sh" --list)
[ ${#packed[@]} -gt 0 ] || fail "gpu-pack.sh --list printed nothing"

mkdir -p "$tmp/build/bin" "$tmp/path"
ran=$tmp/ran.txt
: >"$ran"
for p in "${packed[@]}"; do
  printf '#!/bin/sh\necho "%s" >>"%s"\necho "PASS TFLOP/s"\n' "$p" "$ran" >"$tmp/build/bin/$p"
  chmod +x "$tmp/build/bin/$p"
done
printf '#!/bin/sh\necho "GPU 0: Stand-in GPU (UUID: GPU-0)"\n' >"$tmp/path/nvidia-smi"
# mpirun [options] -np N [-x VAR=V] PROGRAM ARGS: runs PROGRAM once.
cat >"$tmp/path/mpirun" <<'EOF'
#!/bin/bash
while [ $# -gt 0 ]; do
  case $1 in
    --oversubscribe) shift ;;
    --bind-to | -np | -x) shift 2 ;;
    *) break ;;
  esac
done
exec "$@"
EOF
# compute-sanitizer --tool T --error-exitcode N PROGRAM ARGS: records its arguments, runs PROGRAM.
cat >"$tmp/path/compute-sanitizer" <<EOF
#!/bin/bash
echo "\$*" >>"$tmp/sanitizer.txt"
EOF
cat >>"$tmp/path/compute-sanitizer" <<'EOF'
while [[ $# -gt 0 && $1 == --* ]]; do shift 2; done
exec "$@"
EOF
# ncu --option VALUE ... PROGRAM ARGS: records its arguments, runs PROGRAM.
cat >"$tmp/path/ncu" <<EOF
#!/bin/bash
echo "\$*" >>"$tmp/ncu.txt"
EOF
cat >>"$tmp/path/ncu" <<'EOF'
while [[ $# -gt 0 && $1 == --* ]]; do shift 2; done
exec "$@"
EOF
# No PyTorch: the SDPA step is skipped (it runs a script from the checkout, not a packed program).
printf '#!/bin/sh\n[ "$1" = -c ] && exit 1\nexit 1\n' >"$tmp/path/python3"
chmod +x "$tmp/path/"*

PATH="$tmp/path:$PATH" TPX_BUILD="$tmp/build" "$root/scripts/gpu-validate.sh" "$tmp/out" \
  >"$tmp/validate.txt" 2>&1
report=$tmp/out/report.md
[ -f "$report" ] || fail "gpu-validate.sh wrote no report: $(tail -5 "$tmp/validate.txt")"
missing=$(grep -o 'missing from the build ([^)]*)' "$tmp/validate.txt")
[ -z "$missing" ] || fail "gpu-validate.sh runs programs gpu-pack.sh does not pack: $missing"
# Each step's invocations (the stand-ins were called at least once each).
mapfile -t used < <(sort -u "$ran")
unused=$(comm -23 <(printf '%s\n' "${packed[@]}" | sort -u) <(printf '%s\n' "${used[@]}"))
[ -z "$unused" ] || fail "gpu-pack.sh packs programs gpu-validate.sh never runs: $unused"
[ "$(grep -c '^| [0-9]' "$report")" -ge 30 ] || fail "expected every part's steps in: $(cat "$report")"
# memcheck stays strict on every kernel but leaves out the one test that makes a CUDA call fail on
# purpose (compute-sanitizer reports the API error it provokes); that test must still exist.
deliberate=Check.MacrosNameTheCallAndTheLibrarysError
grep -q "TEST(Check, MacrosNameTheCallAndTheLibrarysError)" "$root/tests/test_cuda_ops.cc" ||
  fail "tests/test_cuda_ops.cc no longer has $deliberate: update gpu-validate.sh's memcheck filter"
memcheck=$(grep -- '--tool memcheck' "$tmp/sanitizer.txt" | grep test_cuda_ops)
[ -n "$memcheck" ] || fail "no memcheck run of test_cuda_ops"
grep -q -- "--gtest_filter=-.*$deliberate" <<<"$memcheck" ||
  fail "memcheck of test_cuda_ops does not leave out $deliberate: $memcheck"
# The profile part: Nsight Compute on the fused attention's kernels of bench_attention.
grep -q -- "--kernel-name regex:flash_ .*/bench_attention" "$tmp/ncu.txt" 2>/dev/null ||
  fail "no ncu run of bench_attention's flash_ kernels: $(cat "$tmp/ncu.txt" 2>/dev/null)"
echo "gpu-pack: packs the ${#packed[@]} programs gpu-validate.sh runs, and only those"
