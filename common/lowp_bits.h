// The low-precision formats past FP8 bit by bit, in the style of common/fp8_bits.h (integer
// operations, host and device, the same bits on both): the 4-bit element format E2M1 and the two
// block-scale formats E8M0 (MXFP8's, MXFP4's) and UE4M3 (NVFP4's). Like fp8_bits.h it includes
// nothing a .cu file cannot.
//
//   E2M1 (FP4), OCP Microscaling Formats (MX) Specification v1.0 (Open Compute Project, 2023),
//   its FP4 element format: sign | 2 exponent bits | 1 mantissa bit, bias 1, no infinities, no NaN.
//
//        3   2 1   0
//      +---+-----+---+
//      | S | E E | M |     normal    (E = 1..3):  (−1)^S · 2^(E−1) · (1 + M/2)
//      +---+-----+---+     subnormal (E = 0):     (−1)^S · 2^0     ·      M/2
//
//      codes 0..7 (S = 0):  0  0.5  1  1.5  2  3  4  6        (8..15: the same, negative)
//
//   The cast from fp32 is fp8_bits.h's, which depends only on the mantissa width, the bias and
//   the largest code: round to nearest, ties to even, saturating to ±6 (±inf included). E2M1 has
//   no NaN to carry a NaN; encode gives ±6 for it (the sign kept), and the block scale carries
//   the NaN instead (a NaN in a block makes its scale NaN: see common/lowp.h).
//
//   E8M0, the MX specification's scale format: 8 bits, no sign, no mantissa,
//   bias 127. Code c is 2^(c − 127) for c = 0..254 (2^−127, an fp32 subnormal, up to 2^127);
//   0xFF is NaN; there is no zero and no infinity.
//
//   UE4M3, NVFP4's block scale (NVIDIA, "Pretraining Large Language Models with NVFP4", 2025,
//   its description of the format; cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3): E4M3 (OFP8, see
//   common/fp8.h) with the sign bit always 0. A scale is never negative: encode gives the NaN code
//   0x7F for a NaN or a negative value (−0 is +0), and decode reads a code with bit 7 set as NaN.
//
// defines: tpx::lowp::kE2M1, e2m1_encode, e2m1_decode, e2m1_encode_stochastic, kE8M0NaN, e8m0_decode,
//          e8m0_from_exponent, e8m0_floor, floor_log2, pow2, emax, ue4m3_encode, ue4m3_decode
#pragma once

#include <cstdint>

#include "common/fp8_bits.h"
#include "common/host_device.h"

namespace tpx::lowp {

/// E2M1 as fp8_bits.h's arithmetic sees it: one mantissa bit, bias 1, largest code 0b111 (6).
/// The NaN code is the largest code (E2M1 has no NaN; see above). The exponent is 2 bits wide,
/// which only fp8::decode's infinity test would read, and E2M1 has no infinities.
inline constexpr fp8::Format kE2M1{1, 1, 0x07, 0x07, false};

/// The E2M1 code of v (bits 0..3, bit 3 the sign): nearest, ties to even, saturating to ±6, NaN
/// to ±6 with its sign, −0 to code 8.
TPX_HD inline std::uint8_t e2m1_encode(float v) {
  const std::uint8_t c = fp8::encode(v, kE2M1);  // sign in bit 7, magnitude in bits 0..2
  return static_cast<std::uint8_t>(((c & 0x80u) >> 4) | (c & 0x07u));
}

/// The fp32 value of E2M1 code q (bits 0..3; the upper four bits are ignored). Exact.
TPX_HD inline float e2m1_decode(std::uint8_t q) {
  return fp8::decode(static_cast<std::uint8_t>(((q & 0x08u) << 4) | (q & 0x07u)), kE2M1);
}

/// The E2M1 code of v rounded stochastically (NVFP4's gradients; common/lowp.h): |v| between the
/// neighbouring E2M1 values lo < hi goes to hi with probability (|v| − lo) / (hi − lo), up where
/// |v| − lo > u · (hi − lo) with u = (bits >> 8) · 2^−24 uniform on [0, 1). Both sides are exact in
/// fp32 (|v| − lo by Sterbenz's lemma, as lo <= |v| < hi <= 2·lo or lo = 0; the gap hi − lo is
/// 0.5, 1 or 2, so u · gap only shifts u's exponent), so every backend rounds alike. A value on the
/// grid stays; |v| >= 6 saturates to ±6 and a NaN goes to ±6 with its sign, as e2m1_encode; −0
/// stays −0.
TPX_HD inline std::uint8_t e2m1_encode_stochastic(float v, std::uint32_t bits) {
  const std::uint32_t b = fp8::float_bits(v);
  const std::uint8_t sign = (b & 0x80000000u) != 0 ? 0x08u : 0x00u;
  const float a = fp8::bits_float(b & 0x7FFFFFFFu);
  if (fp8::is_nan(v) || a >= 6.0f) return static_cast<std::uint8_t>(sign | 0x07u);
  std::uint8_t lo = 0;  // the largest code whose value is at most a
  while (lo < 0x06u && e2m1_decode(static_cast<std::uint8_t>(lo + 1)) <= a) ++lo;
  const float lo_value = e2m1_decode(lo);
  if (lo_value == a) return static_cast<std::uint8_t>(sign | lo);
  const float gap = e2m1_decode(static_cast<std::uint8_t>(lo + 1)) - lo_value;
  const float u = float(bits >> 8) * 5.9604644775390625e-08f;  // · 2^−24
  const bool up = a - lo_value > u * gap;
  return static_cast<std::uint8_t>(sign | (lo + (up ? 1 : 0)));
}

/// The exponent of the largest normal value of an element format, the MX specification's
/// emax_elem: 8 (E4M3, 448 = 1.75 · 2^8), 15 (E5M2, 57344), 2 (E2M1, 6 = 1.5 · 2^2).
TPX_HD inline int emax(fp8::Format f) {
  return int(f.max_code >> f.mantissa_bits) - f.bias;
}

/// 2^e as an fp32 value, for −149 <= e <= 127 (below −126 an fp32 subnormal). Exact.
TPX_HD inline float pow2(int e) {
  if (e >= -126) return fp8::bits_float(std::uint32_t(e + 127) << 23);
  return fp8::bits_float(1u << (e + 149));
}

/// floor(log2 v) of a finite v > 0, fp32 subnormals included (−149 for the smallest): the
/// exponent field, or for a subnormal the position of its highest set bit, less 149.
TPX_HD inline int floor_log2(float v) {
  const std::uint32_t a = fp8::float_bits(v) & 0x7FFFFFFFu;
  if (a >= 0x00800000u) return int(a >> 23) - 127;
  int top = 0;
  for (std::uint32_t m = a; m > 1u; m >>= 1) ++top;
  return top - 149;
}

/// E8M0's NaN, the only code that is not a power of two.
inline constexpr std::uint8_t kE8M0NaN = 0xFF;

/// The value of E8M0 code c: 2^(c − 127), NaN for 0xFF (fp32's quiet NaN).
TPX_HD inline float e8m0_decode(std::uint8_t c) {
  if (c == kE8M0NaN) return fp8::bits_float(fp8::kNaNBits);
  return pow2(int(c) - 127);
}

/// The E8M0 code of 2^e: e below −127 clamps to 2^−127 (code 0); e above 127, past the format,
/// gives NaN (the MX paper's reference implementation does both).
TPX_HD inline std::uint8_t e8m0_from_exponent(int e) {
  if (e > 127) return kE8M0NaN;
  if (e < -127) return 0;
  return static_cast<std::uint8_t>(e + 127);
}

/// The largest E8M0 value at most v (rounding toward zero in the exponent; PTX's cvt.rz to
/// ue8m0 rounds the same way): e8m0_from_exponent(floor(log2 v)) for a finite v > 0; ±0 gives
/// code 0 (log2 0 = −∞ clamps to −127); a NaN, a negative v or +inf give NaN.
TPX_HD inline std::uint8_t e8m0_floor(float v) {
  const std::uint32_t u = fp8::float_bits(v);
  if ((u & 0x7FFFFFFFu) == 0) return 0;
  if (u >= 0x7F800000u) return kE8M0NaN;  // NaN (either sign), +inf, and every negative value
  return e8m0_from_exponent(floor_log2(v));
}

/// The UE4M3 code of a scale v: E4M3's cast (nearest, ties to even, saturating to 448, +inf
/// included); NaN and negative values give the NaN code 0x7F; −0 gives 0.
TPX_HD inline std::uint8_t ue4m3_encode(float v) {
  const std::uint32_t u = fp8::float_bits(v);
  if (u == 0x80000000u) return 0;
  if (fp8::is_nan(v) || (u & 0x80000000u) != 0) return fp8::kE4M3.nan_code;
  return fp8::encode(v, fp8::kE4M3);
}

/// The value of UE4M3 code c: E4M3's value for c <= 0x7E; NaN for 0x7F and for every code with
/// bit 7 set (not a UE4M3 code).
TPX_HD inline float ue4m3_decode(std::uint8_t c) {
  if (c >= fp8::kE4M3.nan_code) return fp8::bits_float(fp8::kNaNBits);
  return fp8::decode(c, fp8::kE4M3);
}

}  // namespace tpx::lowp
