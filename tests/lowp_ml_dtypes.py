#!/usr/bin/env python3
"""The low-precision casts against ml_dtypes, an independent implementation of the formats.

Writes a set of fp32 inputs, runs the lowp_casts tool (tests/lowp_casts.cc: the casts of
common/fp8_bits.h and common/lowp_bits.h as tables) on them, and compares, format by format:

  decode  every code (256; E2M1's 16) against ml_dtypes' value of the same bits: equal bits, or
          both NaN with the same sign;
  encode  every input against ml_dtypes' cast of it, where the project's rules are stated on top
          of the plain cast: the FP8/FP4 casts saturate (the input is clipped to ±max first;
          ml_dtypes' own overflow gives NaN or inf), a NaN keeps its sign (the project's NaN code
          is checked exactly, ml_dtypes' only for being a NaN of that sign; E2M1 has no NaN and
          the project's ±6 for one is checked alone), UE4M3 is E4M3 on
          values >= 0 (a NaN or a negative scale gives 0x7F), and E8M0's encode is the MX scale's
          floor: the largest code whose ml_dtypes value is at most the input (code 0 below 2^-127
          and for ±0; 0xFF for NaN, negative values and +inf).

The inputs: every fp32 pattern whose low 12 bits are 0x000, 0x001 or 0xFFF (each exponent, the
top 11 mantissa bits, so every rounding tie of every format and the values either side of it),
both signs; 10^6 random patterns; and the edge cases (±0, ±inf, NaNs of both signs and several
payloads, fp32 subnormals, each format's max and its neighbours).

    lowp_ml_dtypes.py --bin build/bin/lowp_casts --work DIR [--python .venv-hf/bin/python]

The comparison also shows that it can fail: one code of the tool's output changed must be caught.
Exit status: 0 pass, 1 mismatch, 2 bad input or a failed run of the tool, 77 (a skip for ctest)
where numpy or ml_dtypes cannot be imported. With --python, the script runs itself under that
interpreter (scripts/setup.sh's .venv-hf, which pins ml_dtypes) when it exists.
"""
import argparse
import os
import shutil
import subprocess
import sys

from under_python import rerun_under

SKIP = 77
np = None
ml_dtypes = None


def fail(message):
    print(f"lowp_ml_dtypes: error: {message}", file=sys.stderr)
    sys.exit(2)


def inputs():
    """The fp32 inputs, as uint32 bit patterns."""
    top = np.arange(1 << 19, dtype=np.uint32) << np.uint32(12)  # sign clear, all exponents
    sweep = np.concatenate([top, top | np.uint32(0x001), top | np.uint32(0xFFF)])
    sweep = np.concatenate([sweep, sweep | np.uint32(0x80000000)])
    rng = np.random.default_rng(1234)
    random = rng.integers(0, 1 << 32, size=1_000_000, dtype=np.uint64).astype(np.uint32)
    f32 = lambda v: np.float32(v).view(np.uint32)  # noqa: E731
    edges = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
             0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x00000001, 0x80000001,
             0x007FFFFF, 0x00400000, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF]
    for m in (448.0, 57344.0, 6.0, 2.0 ** 127, 2.0 ** -127, 2.0 ** -126):
        for v in (m, -m):
            b = int(f32(v))
            edges += [b - 1, b, b + 1]
    for v in (464.0, 480.0, 61440.0, 5.0, 7.0, 0.25, 0.75, 2.0 ** -10, 2.0 ** -17):
        edges += [int(f32(v)), int(f32(-v))]
    return np.concatenate([sweep, random, np.array(edges, dtype=np.uint32)])


def same_value(ours, theirs):
    """Per element: equal bits, or both NaN with the same sign."""
    ob, tb = ours.view(np.uint32), theirs.view(np.uint32)
    both_nan = np.isnan(ours) & np.isnan(theirs)
    return np.where(both_nan, (ob >> 31) == (tb >> 31), ob == tb)


def compare(name, what, good, values, ours, theirs):
    bad = np.flatnonzero(~good)
    if bad.size:
        print(f"FAIL {name} {what}: {bad.size} of {good.size} differ; first: "
              + ", ".join(f"{values[i]:#x} ours {int(ours[i]):#x} ml_dtypes {int(theirs[i]):#x}"
                          if ours.dtype == np.uint8 else
                          f"{values[i]:#x} ours {ours[i]!r} ml_dtypes {theirs[i]!r}"
                          for i in bad[:5]))
        return 1
    print(f"ok   {name} {what}: {good.size} equal")
    return 0


def expected_codes(name, x):
    """ml_dtypes' codes for the fp32 inputs x under the project's stated rules, and a mask of the
    NaN results (compared by sign and the project's NaN code rather than ml_dtypes' bits)."""
    dt = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2,
          "e2m1": ml_dtypes.float4_e2m1fn, "ue4m3": ml_dtypes.float8_e4m3fn}
    fmax = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0, "ue4m3": 448.0}
    with np.errstate(invalid="ignore", over="ignore"):
        if name == "e8m0":
            table = np.arange(255, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu) \
                .astype(np.float32)
            positive = (x > 0) & np.isfinite(x)
            index = np.searchsorted(table, np.where(positive, x, 1.0), side="right") - 1
            codes = np.where(positive, np.maximum(index, 0), 0xFF).astype(np.uint8)
            codes[x == 0] = 0
            return codes, np.zeros(x.shape, dtype=bool)
        if name == "ue4m3":
            valid = ~np.isnan(x) & ~np.signbit(x)
            clipped = np.where(valid, np.minimum(x, fmax[name]), 0.0).astype(np.float32)
            codes = clipped.astype(dt[name]).view(np.uint8)
            codes = np.where(valid, codes, 0x7F).astype(np.uint8)
            codes[x == 0] = 0  # −0 too
            return codes, np.zeros(x.shape, dtype=bool)
        clipped = np.clip(x, -fmax[name], fmax[name]).astype(np.float32)  # NaN stays NaN
        codes = clipped.astype(dt[name]).view(np.uint8).copy()
        return codes, np.isnan(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True, help="the lowp_casts executable")
    ap.add_argument("--work", required=True, help="a directory for the tables (replaced)")
    ap.add_argument("--python", help="run under this interpreter when it exists")
    a = ap.parse_args()
    rerun_under(a.python, __file__)

    global np, ml_dtypes
    try:
        import numpy as np
        import ml_dtypes
    except ImportError as e:
        print(f"SKIPPED: {e} (scripts/setup.sh installs ml_dtypes for {sys.executable})")
        return SKIP
    print(f"numpy {np.__version__}, ml_dtypes {ml_dtypes.__version__}, python {sys.executable}")

    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    bits = inputs()
    np.save(os.path.join(a.work, "inputs.npy"), bits.view(np.float32))
    run = subprocess.run([a.bin, os.path.join(a.work, "inputs.npy"), a.work],
                         capture_output=True, text=True)
    if run.returncode != 0:
        fail(f"{a.bin} exited {run.returncode}: {run.stderr.strip()}")
    x = bits.view(np.float32)

    mismatches = 0
    theirs_decode = {
        "e4m3": np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn),
        "e5m2": np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e5m2),
        "e2m1": np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn),
        # UE4M3: E4M3's positive codes; bit 7 set is not a UE4M3 code and reads as NaN.
        "ue4m3": np.concatenate([np.arange(128, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                                 .astype(np.float32), np.full(128, np.nan, np.float32)]),
        "e8m0": np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu),
    }
    nan_code = {"e4m3": 0x7F, "e5m2": 0x7E, "e2m1": 0x07}
    for name, theirs in theirs_decode.items():
        ours = np.load(os.path.join(a.work, f"{name}.decode.npy"))
        theirs = np.asarray(theirs).astype(np.float32)
        if ours.shape != theirs.shape:
            fail(f"{name}.decode.npy has shape {ours.shape}, expected {theirs.shape}")
        mismatches += compare(name, "decode (every code)", same_value(ours, theirs),
                              np.arange(ours.size), ours, theirs)

        ours = np.load(os.path.join(a.work, f"{name}.encode.npy"))
        want, nan_mask = expected_codes(name, x)
        good = ours == want
        if name in nan_code:
            sign = np.uint8(0x08 if name == "e2m1" else 0x80)
            negative = np.signbit(x)
            good = np.where(nan_mask, ours == np.where(negative, sign | nan_code[name],
                                                       nan_code[name]).astype(np.uint8), good)
            # ml_dtypes' code for the same NaN must be a NaN code of the same sign. E2M1 has no
            # NaN, and ml_dtypes' code for one depends on the payload (±6 for the quiet NaN,
            # other codes for others): there only the project's stated ±6 is checked.
            if name != "e2m1":
                theirs_nan = want.view({"e4m3": ml_dtypes.float8_e4m3fn,
                                        "e5m2": ml_dtypes.float8_e5m2}[name]).astype(np.float32)
                agree = np.isnan(theirs_nan) & ((want & 0x80) == (ours & 0x80))
                good &= np.where(nan_mask, agree, True)
        mismatches += compare(name, f"encode ({x.size} fp32 inputs)", good, bits, ours, want)

    # The comparison catches a single wrong code.
    ours = np.load(os.path.join(a.work, "e4m3.encode.npy"))
    want, _ = expected_codes("e4m3", x)
    i = int(np.flatnonzero((np.abs(x) > 1) & (np.abs(x) < 2))[0])
    ours[i] ^= 1
    if (ours == want).all():
        print("FAIL self-test: an e4m3 code changed by one went unnoticed")
        mismatches += 1
    else:
        print("ok   self-test: an e4m3 code changed by one is caught")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
