// The FP8 casts bit by bit: fp32 <-> OCP E4M3 / E5M2 with integer operations only, so that one
// function runs on the host (the cpu backend, the tests) and inside CUDA kernels and gives the
// same bits on both. The formats are drawn in common/fp8.h; this header holds the arithmetic.
// It includes nothing but <cstdint> and <cstring>: .cu files (C++17) include it as well.
//
// Encoding v (an fp32 value, already multiplied by the scale) as an FP8 code:
//
//   NaN         → the format's NaN with v's sign (E4M3 S.1111.111, E5M2 S.11111.10)
//   |v| >= max  → ±max: saturation, ±inf included, in E5M2 too (which has infinities)
//   otherwise   round to nearest, ties to even, on the fp32 bits:
//     normal    fp32 and FP8 differ only in the exponent bias and the mantissa width, so
//               subtracting (127 − bias) from the exponent field and shifting the mantissa right
//               by 23 − M bits (rounding) gives the code; a mantissa that rounds up carries into
//               the exponent by itself (1.111 → 10.000), which is the next code.
//     subnormal the code is |v| / 2^(1 − bias − M) (the subnormal step), rounded: the fp32
//               significand 1.f shifted right by as many bits as that division takes; at
//               the top it rounds up to the first normal code, at the bottom anything below half
//               the step becomes ±0 (exactly half is a tie and goes to the even code, 0).
//
// Rounding a right shift by s to nearest even:  (x + 2^(s−1) − 1 + lowest kept bit) >> s.
// When the dropped bits are below half (2^(s−1)), adding 2^(s−1) − 1 does not carry into the kept
// bits; above half it does; at exactly half it carries only if the lowest kept bit is 1, so an odd
// result rounds up to the even one and an even result stays.
//
// defines: tpx::fp8::Format, kE4M3, kE5M2, encode, decode, max_normal, quantize,
//          dequantize, scale_from_amax, float_bits, bits_float, is_nan, kNaNBits
#pragma once

#include <cstdint>
#include <cstring>

#include "common/host_device.h"

namespace tpx::fp8 {

/// What distinguishes the two formats. Codes are written with the sign bit clear; the sign is
/// bit 7 of every code.
struct Format {
  int mantissa_bits;      ///< M: 3 (E4M3) or 2 (E5M2); the exponent has 7 − M bits
  int bias;               ///< 7 (E4M3) or 15 (E5M2)
  std::uint8_t max_code;  ///< the largest finite magnitude
  std::uint8_t nan_code;  ///< the NaN encode produces
  bool has_inf;           ///< exponent all ones: E5M2 inf/NaN, E4M3 ordinary numbers (bar NaN)
};

/// OCP E4M3 ("e4m3fn"): max S.1111.110 = 448, NaN S.1111.111 only.
inline constexpr Format kE4M3{3, 7, 0x7E, 0x7F, false};
/// OCP E5M2: max S.11110.11 = 57344, inf S.11111.00, NaN S.11111.{01,10,11}; encode writes
/// S.11111.10, the quiet NaN with the top mantissa bit set (what fp32's 0x7FC00000 truncates to).
inline constexpr Format kE5M2{2, 15, 0x7B, 0x7E, true};

/// fp32's canonical quiet NaN (sign clear), what decode and amax write for every NaN.
inline constexpr std::uint32_t kNaNBits = 0x7FC00000u;

/// The bits of a float and the float of some bits.
TPX_HD inline std::uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  std::uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
#endif
}
TPX_HD inline float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
#endif
}

/// x / 2^s rounded to nearest, ties to even (1 <= s <= 31, x + 2^(s−1) below 2^32).
TPX_HD inline std::uint32_t shift_right_rne(std::uint32_t x, int s) {
  const std::uint32_t kept_lsb = (x >> s) & 1u;
  return (x + (1u << (s - 1)) - 1u + kept_lsb) >> s;
}

/// The fp32 bits of a normal FP8 magnitude (exponent field >= 1): the mantissa moved to the top
/// of fp32's 23 bits, the exponent rebiased from `bias` to 127. Exact.
TPX_HD inline std::uint32_t normal_f32_bits(std::uint32_t magnitude, Format f) {
  return (magnitude << (23 - f.mantissa_bits)) + (std::uint32_t(127 - f.bias) << 23);
}

/// The largest finite value of the format: 448 (E4M3) or 57344 (E5M2).
TPX_HD inline float max_normal(Format f) {
  return bits_float(normal_f32_bits(f.max_code, f));
}

/// The FP8 code of v: round to nearest even, saturating to ±max, NaN to NaN, −0 to −0.
TPX_HD inline std::uint8_t encode(float v, Format f) {
  const std::uint32_t u = float_bits(v);
  const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const std::uint32_t a = u & 0x7FFFFFFFu;  // |v|
  if (a > 0x7F800000u) return static_cast<std::uint8_t>(sign | f.nan_code);
  // At or past max, ±inf included. (Up to the midpoint between max and the code above it,
  // rounding gives max anyway; beyond, it would give that code: E4M3's NaN, E5M2's inf.)
  if (a >= normal_f32_bits(f.max_code, f)) return static_cast<std::uint8_t>(sign | f.max_code);

  const int drop = 23 - f.mantissa_bits;    // fp32 mantissa bits that FP8 does not keep
  const int exponent = int(a >> 23) - 127;  // unbiased; fp32 subnormals read as −127
  if (exponent + f.bias >= 1) {             // a normal FP8 number
    const std::uint32_t rebiased = a - (std::uint32_t(127 - f.bias) << 23);
    return static_cast<std::uint8_t>(sign | shift_right_rne(rebiased, drop));
  }
  // Subnormal FP8, or zero. |v| = significand · 2^(exponent − 23) with the implicit leading one;
  // in steps of 2^(1 − bias − M) that is significand / 2^shift.
  const std::uint32_t significand = (a & 0x7FFFFFu) | 0x800000u;
  const int shift = (1 - f.bias - f.mantissa_bits) - (exponent - 23);  // >= drop + 1
  // significand < 2^24, so from shift 25 on |v| is below half a step: ±0. fp32 zeros and
  // subnormals (far below FP8's range) leave here too, whatever their significand reads as.
  if (shift >= 25) return sign;
  return static_cast<std::uint8_t>(sign | shift_right_rne(significand, shift));
}

/// The fp32 value of an FP8 code (exact: every FP8 value is an fp32 value). NaN codes give fp32's
/// canonical quiet NaN with the code's sign; E5M2's inf codes give ±inf.
TPX_HD inline float decode(std::uint8_t q, Format f) {
  const std::uint32_t sign = std::uint32_t(q & 0x80u) << 24;
  const std::uint32_t magnitude = q & 0x7Fu;
  const std::uint32_t exponent_field = magnitude >> f.mantissa_bits;
  const std::uint32_t all_ones = 0x7Fu >> f.mantissa_bits;
  if (f.has_inf && exponent_field == all_ones) {
    const bool inf = magnitude == all_ones << f.mantissa_bits;  // mantissa 0
    return bits_float(sign | (inf ? 0x7F800000u : kNaNBits));
  }
  if (!f.has_inf && magnitude == 0x7Fu) return bits_float(sign | kNaNBits);
  if (exponent_field == 0) {
    // Subnormal: mantissa · 2^(1 − bias − M). Both factors and the product are exact fp32.
    const float step = bits_float(std::uint32_t(127 + 1 - f.bias - f.mantissa_bits) << 23);
    return bits_float(sign | float_bits(static_cast<float>(magnitude) * step));
  }
  return bits_float(sign | normal_f32_bits(magnitude, f));
}

using hd::div_rn;  // rounded to nearest whatever the device's fast-math flags (host_device.h)
using hd::mul_rn;

/// True for every NaN, by its bits (no floating-point operation, so no fast-math flag can fold it).
TPX_HD inline bool is_nan(float v) {
  return (float_bits(v) & 0x7FFFFFFFu) > 0x7F800000u;
}

// NaN through the scaling, decided once for both backends. The OCP 8-bit Floating Point
// Specification (OFP8, rev. 1.0, its table of the two formats' special values) gives each format
// NaNs of both signs (E4M3 S.1111.111, E5M2 S.11111.{01,10,11}) and asks only that a NaN convert
// to a NaN; DESIGN's recipe says "NaN stays NaN". This project keeps the sign as well (encode
// and decode above, pinned by tests/test_fp8.cc). IEEE 754-2019 (section 6.3) leaves the sign of
// a NaN that comes out of an arithmetic operation unspecified, and the two backends do differ:
// x86's SSE multiply and divide return the NaN operand quieted, sign and payload kept, while a
// GPU's fp32 multiply and divide return the canonical NaN 0x7FFFFFFF, whatever the operand's
// sign. So a NaN must not go through x · scale or q / scale: quantize encodes a NaN x directly
// (its sign kept) and dequantize returns decode's NaN (the code's sign, fp32's quiet NaN
// 0x7FC00000) as it is. Every other value, ±inf, ±0 and fp32 subnormals included, goes through
// the one correctly rounded operation, which gives the same bits on both (the device code is
// built without -ftz / --use_fast_math, which would flush the subnormals).

/// Stage 06's quantization: the code of x · scale, the product rounded to fp32 first; a NaN x
/// gives the format's NaN with x's sign.
TPX_HD inline std::uint8_t quantize(float x, float scale, Format f) {
  return encode(is_nan(x) ? x : mul_rn(x, scale), f);
}

/// Stage 06's dequantization: decode(q) / scale, one fp32 division (not a multiplication by
/// 1 / scale, which rounds twice and can differ in the last bit); a NaN code gives fp32's quiet
/// NaN with the code's sign.
TPX_HD inline float dequantize(std::uint8_t q, float scale, Format f) {
  const float v = decode(q, f);
  return is_nan(v) ? v : div_rn(v, scale);
}

/// The per-tensor scale of current scaling: fmax / amax in fp32, except where that is no usable
/// scale. amax = 0 (an all-zero tensor), +inf or NaN give 1; an amax so small that the quotient
/// overflows gives the largest finite float instead of inf (inf would make 0 · scale a NaN).
/// These are Transformer Engine's rules for current scaling.
TPX_HD inline float scale_from_amax(float amax, float fmax) {
  const bool finite_positive = amax > 0.0f && float_bits(amax) < 0x7F800000u;
  if (!finite_positive) return 1.0f;
  const float scale = div_rn(fmax, amax);
  return float_bits(scale) == 0x7F800000u ? bits_float(0x7F7FFFFFu) : scale;
}

}  // namespace tpx::fp8
