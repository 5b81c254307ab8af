#!/usr/bin/env bash
# Tensor::zeros fills host memory only (a device tensor is zeroed by ops::fill, on the stream that
# uses it), so it takes no device: a call that asks it for a device tensor must not compile, in
# any stage, tool or test, rather than fail at run time on the first machine with a GPU. Compiles
# (syntax only) the calls that must build and the ones that must not, against common/tensor.h.
#
#   tests/host_only_zeros_test.sh <c++ compiler> <source root>
set -uo pipefail
cxx=$1
root=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Compiles the body of a function against common/tensor.h; prints the compiler's messages.
compiles() {
  printf '#include "common/tensor.h"\nusing namespace tpx;\nvoid f(Device device_, long n, long kv) {\n  (void)device_, (void)n, (void)kv;\n  %s\n}\n' \
    "$1" >"$tmp/t.cc"
  "$cxx" -std=c++20 -fsyntax-only -I"$root" "$tmp/t.cc" >"$tmp/out.txt" 2>&1
}

status=0
for ok in 'const Tensor t = Tensor::zeros({2, 3});' \
  'const Tensor t = Tensor::zeros({4}, DType::bf16);' \
  'const Tensor t = Tensor::empty({n * 2 * kv}, DType::f32, device_);'; do
  if ! compiles "$ok"; then
    echo "FAIL: does not compile: $ok"
    cat "$tmp/out.txt"
    status=1
  fi
done
# The first form is the call that failed at run time in stage 08's all-gather backward.
for bad in 'const Tensor dall = Tensor::zeros({n * 2 * kv}, DType::f32, device_);' \
  'const Tensor t = Tensor::zeros({4}, DType::f32, Device::cuda);' \
  'const Tensor t = Tensor::zeros({4}, DType::f32, Device::cpu);'; do
  if compiles "$bad"; then
    echo "FAIL: compiles, but must not (Tensor::zeros is host-only; use Tensor::empty + ops::fill): $bad"
    status=1
  elif ! grep -q "zeros" "$tmp/out.txt"; then
    echo "FAIL: does not compile, but not for naming a device in Tensor::zeros: $bad"
    cat "$tmp/out.txt"
    status=1
  fi
done
[ "$status" -eq 0 ] && echo "Tensor::zeros is host-only: every call that names a device fails to compile"
exit "$status"
