#!/usr/bin/env bash
# TPX_EXPECT_GPU=1 must turn the GPU tests' skips into failures (tests/test_cuda.h). Runs a GPU
# test program twice, as it is and with TPX_EXPECT_GPU=1. Where its GPU tests skip (no usable
# GPU), the second run must fail and say why; where a GPU runs them, both runs must pass.
#
#   tests/expect_gpu.sh <test program> [gtest flags...]
set -uo pipefail
program=$1
shift
plain=$("$program" "$@" 2>&1)
plain_rc=$?
expect=$(TPX_EXPECT_GPU=1 "$program" "$@" 2>&1)
expect_rc=$?
if grep -q "no usable GPU" <<<"$plain"; then
  if [ "$expect_rc" -ne 0 ] && grep -q "TPX_EXPECT_GPU=1, but no usable GPU" <<<"$expect"; then
    echo "no usable GPU: the tests skip, and under TPX_EXPECT_GPU=1 they fail, naming the reason"
    exit 0
  fi
  echo "no usable GPU, yet under TPX_EXPECT_GPU=1 the tests did not fail (exit $expect_rc):"
  echo "$expect"
  exit 1
fi
if [ "$plain_rc" -eq 0 ] && [ "$expect_rc" -eq 0 ]; then
  echo "a GPU ran the tests: they pass with and without TPX_EXPECT_GPU=1"
  exit 0
fi
echo "with a GPU the runs must pass (exit $plain_rc, and $expect_rc under TPX_EXPECT_GPU=1):"
echo "$plain"
exit 1
