// FP8: the two 8-bit floating-point formats of stage 06, as defined by the OCP 8-bit Floating
// Point Specification (OFP8, revision 1.0, Open Compute Project, 2023), and exact software casts
// between them and fp32. No hardware FP8 and no compiler FP8 type is involved: the casts are
// integer bit manipulation (common/fp8_bits.h), shared with the CUDA kernels, so the cpu and the
// cuda backends produce the same bytes.
//
// Both formats are sign | exponent | mantissa, like IEEE 754, with an implicit leading 1 for
// normal numbers and none for subnormals (exponent field 0):
//
//   E4M3 ("e4m3fn"): activations and weights. Bias 7, no infinities.
//
//        7   6 5 4 3   2 1 0
//      +---+---------+-------+
//      | S | E E E E | M M M |     normal    (E = 1..15):  (−1)^S · 2^(E−7) · (1 + M/8)
//      +---+---------+-------+     subnormal (E = 0):      (−1)^S · 2^(−6)  ·      M/8
//
//      max normal     S.1111.110   0x7E   1.75 · 2^8   = 448
//      min normal     S.0001.000   0x08   1.0  · 2^−6  = 0.015625
//      min subnormal  S.0000.001   0x01   0.125 · 2^−6 = 2^−9 = 0.001953125
//      zero           S.0000.000   0x00, 0x80 (−0)
//      NaN            S.1111.111   0x7F, 0xFF   (the only NaNs: E = 15 is an ordinary exponent
//                                               for M = 0..6, which buys 256, 288, … 448)
//
//   E5M2: gradients. Bias 15, IEEE-like (infinities and several NaNs): fp16 with the low byte cut.
//
//        7   6 5 4 3 2   1 0
//      +---+-----------+-----+
//      | S | E E E E E | M M |     normal    (E = 1..30):  (−1)^S · 2^(E−15) · (1 + M/4)
//      +---+-----------+-----+     subnormal (E = 0):      (−1)^S · 2^(−14)  ·      M/4
//
//      max normal     S.11110.11   0x7B   1.75 · 2^15  = 57344
//      min normal     S.00001.00   0x04   1.0  · 2^−14 = 0.00006103515625
//      min subnormal  S.00000.01   0x01   0.25 · 2^−14 = 2^−16 = 0.0000152587890625
//      zero           S.00000.00   0x00, 0x80 (−0)
//      infinity       S.11111.00   0x7C, 0xFC
//      NaN            S.11111.MM   0x7D–0x7F, 0xFD–0xFF (M ≠ 0)
//
// The recipe (stage 06, per-tensor current scaling), identical on both backends:
//   amax  = max |x| over the tensor
//   scale = fmax / amax in fp32 (fmax = 448 or 57344; amax = 0 gives 1, see scale_from_amax)
//   q     = encode(x · scale), the product rounded to fp32, then round to nearest even, saturating
//           to ±fmax (±inf too, in both formats), NaN to NaN, −0 to −0
//   x'    = decode(q) / scale, one fp32 division
// encode writes NaN as 0x7F / 0xFF (E4M3, its only NaN) or 0x7E / 0xFE (E5M2, the quiet NaN),
// keeping the input's sign; decode gives fp32's canonical quiet NaN with the code's sign.
//
// defines: tpx::fp8::format, encode, decode, max_normal (DType overloads of common/fp8_bits.h)
#pragma once

#include <cstdint>

#include "fp8_bits.h"
#include "tensor.h"

namespace tpx::fp8 {

/// The format of an FP8 dtype (e4m3 or e5m2); throws tpx::Error for any other dtype.
Format format(DType dtype);

/// The code of v (v already multiplied by the scale) in `dtype`; see fp8_bits.h's encode.
std::uint8_t encode(float v, DType dtype);
/// The exact fp32 value of code q of `dtype`.
float decode(std::uint8_t q, DType dtype);
/// 448 for e4m3, 57344 for e5m2.
float max_normal(DType dtype);

}  // namespace tpx::fp8
