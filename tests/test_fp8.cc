// The FP8 casts (common/fp8.h, common/fp8_bits.h) and ops against the OCP 8-bit Floating Point
// Specification (OFP8, 2023). Every expected value is derived here from the specification, never
// from the code under test:
//   - all 256 codes of each format decode to the value of the spec's formula (ldexp in long
//     double), and every finite one encodes back to itself;
//   - the named values (max, min normal, min subnormal), ties to even between every two adjacent
//     codes, saturation, NaN and negative zero;
//   - a sweep of fp32 bit patterns against a reference that knows no bits: the nearest of the
//     format's values by long double distance, the even code on a tie, ±max past the largest.
//     The suite sweeps a stratified sample of 1.25·10^7 patterns per format that takes every
//     rounding case at every exponent (see for_each_sweep_pattern); the ctest entry
//     fp8.exhaustive (label `exhaustive`, outside the presets' suite) sweeps all 2^32;
//   - quantize_fp8, dequantize_fp8, amax and fp8_scale on cpu tensors;
//   - the same ops on cuda equal to the cpu ones, bit for bit (skipped where no GPU is usable).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "common/check.h"
#include "common/fp8.h"
#include "common/ops.h"
#include "common/tensor.h"
#include "test_cuda.h"

namespace tpx {
namespace {

using I = std::int64_t;

// ---------------------------------------------------------------------------------------------
// The formats as the specification states them.
// ---------------------------------------------------------------------------------------------

struct Spec {
  DType dtype;
  const char* name;
  int exponent_bits, mantissa_bits, bias;
  bool ieee;              ///< exponent all ones means inf (M = 0) or NaN; else only S.1111.111
  std::uint8_t max_code;  ///< the largest finite magnitude (from the spec's table)
  double max, min_normal, min_subnormal;
  std::uint8_t nan_out;  ///< the NaN code this project's encode writes (sign clear)
};

const Spec kE4M3{DType::e4m3, "e4m3", 4, 3, 7, false, 0x7E, 448.0, 0x1p-6, 0x1p-9, 0x7F};
const Spec kE5M2{DType::e5m2, "e5m2", 5, 2, 15, true, 0x7B, 57344.0, 0x1p-14, 0x1p-16, 0x7E};

/// The value of code c by the spec's formula; NaN for NaN codes (sign checked separately).
long double spec_value(const Spec& s, unsigned c) {
  const bool negative = (c & 0x80u) != 0;
  const unsigned e = (c >> s.mantissa_bits) & ((1u << s.exponent_bits) - 1);
  const unsigned m = c & ((1u << s.mantissa_bits) - 1);
  const unsigned e_ones = (1u << s.exponent_bits) - 1, m_ones = (1u << s.mantissa_bits) - 1;
  const long double fraction = static_cast<long double>(m) / (1u << s.mantissa_bits);
  long double magnitude;
  if (s.ieee && e == e_ones) {
    magnitude = m == 0 ? std::numeric_limits<long double>::infinity()
                       : std::numeric_limits<long double>::quiet_NaN();
  } else if (!s.ieee && e == e_ones && m == m_ones) {
    magnitude = std::numeric_limits<long double>::quiet_NaN();
  } else if (e == 0) {
    magnitude = std::ldexp(fraction, 1 - s.bias);  // subnormal: 0.M · 2^(1 − bias)
  } else {
    magnitude = std::ldexp(1.0L + fraction, int(e) - s.bias);  // normal: 1.M · 2^(E − bias)
  }
  return negative ? -magnitude : magnitude;
}

bool is_nan_code(const Spec& s, unsigned c) {
  return std::isnan(spec_value(s, c));
}

/// The spec's cast, by brute force over the 256 codes: the nearest finite value of v's sign in
/// long double, the even code (even mantissa) on a tie; ±max from max on (±inf included); NaN
/// stays NaN.
std::uint8_t nearest_code(const Spec& s, float v) {
  const unsigned sign = std::signbit(v) ? 0x80u : 0u;
  if (std::isnan(v)) return static_cast<std::uint8_t>(sign | s.nan_out);
  // Saturation, an explicit rule of the recipe (past max every distance would be to max anyway,
  // but far out long double distances can no longer tell the codes apart).
  if (std::fabs(v) >= s.max) return static_cast<std::uint8_t>(sign | s.max_code);
  unsigned best = 0;
  long double best_distance = std::numeric_limits<long double>::infinity();
  for (unsigned c = sign; c < sign + 0x80u; ++c) {
    const long double value = spec_value(s, c);
    if (std::isnan(value) || std::isinf(value)) continue;
    const long double d = std::fabs(static_cast<long double>(v) - value);
    if (d < best_distance || (d == best_distance && c % 2 == 0)) {
      best = c;
      best_distance = d;
    }
  }
  return static_cast<std::uint8_t>(best);
}

std::uint32_t bits(float v) {
  return std::bit_cast<std::uint32_t>(v);
}
float from_bits(std::uint32_t u) {
  return std::bit_cast<float>(u);
}
std::string hex(unsigned v) {
  return fmt::format("{:#04x}", v);
}

/// How gtest prints a Spec parameter: its name.
void PrintTo(const Spec& s, std::ostream* os) {
  *os << s.name;
}

class Fp8Format : public ::testing::TestWithParam<Spec> {};

std::string format_name(const ::testing::TestParamInfo<Spec>& info) {
  return info.param.name;
}

// ---------------------------------------------------------------------------------------------
// Codes and named values.
// ---------------------------------------------------------------------------------------------

TEST_P(Fp8Format, EveryCodeDecodesToTheSpecValue) {
  const Spec& s = GetParam();
  for (unsigned c = 0; c < 256; ++c) {
    const float got = fp8::decode(static_cast<std::uint8_t>(c), s.dtype);
    const long double want = spec_value(s, c);
    const bool negative = (c & 0x80u) != 0;
    EXPECT_EQ(std::signbit(got), negative) << "code " << hex(c);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << hex(c) << " decodes to " << got;
    } else {
      EXPECT_EQ(static_cast<long double>(got), want) << "code " << hex(c);
    }
  }
}

TEST_P(Fp8Format, EveryFiniteCodeEncodesBackToItself) {
  const Spec& s = GetParam();
  int finite = 0;
  for (unsigned c = 0; c < 256; ++c) {
    const long double value = spec_value(s, c);
    if (std::isnan(value) || std::isinf(value)) continue;
    ++finite;
    const auto v = static_cast<float>(value);
    ASSERT_EQ(static_cast<long double>(v), value) << "every FP8 value is an fp32 value";
    EXPECT_EQ(fp8::encode(v, s.dtype), c) << "value " << v << " (code " << hex(c) << ")";
    EXPECT_EQ(fp8::encode(fp8::decode(static_cast<std::uint8_t>(c), s.dtype), s.dtype), c)
        << "code " << hex(c);
  }
  // 254 finite codes in E4M3 (two NaNs); 248 in E5M2 (two infinities, six NaNs).
  EXPECT_EQ(finite, s.ieee ? 248 : 254);
}

TEST_P(Fp8Format, NamedValuesOfTheSpec) {
  const Spec& s = GetParam();
  const auto code_of = [&](double v) { return fp8::encode(static_cast<float>(v), s.dtype); };
  EXPECT_EQ(fp8::max_normal(s.dtype), s.max);
  EXPECT_EQ(code_of(s.max), s.max_code);
  EXPECT_EQ(code_of(-s.max), 0x80 | s.max_code);
  EXPECT_EQ(fp8::decode(s.max_code, s.dtype), s.max);
  const unsigned min_normal_code = 1u << s.mantissa_bits;  // S.0…01.0…0
  EXPECT_EQ(code_of(s.min_normal), min_normal_code);
  EXPECT_EQ(fp8::decode(static_cast<std::uint8_t>(min_normal_code), s.dtype), s.min_normal);
  EXPECT_EQ(code_of(s.min_subnormal), 0x01);
  EXPECT_EQ(code_of(-s.min_subnormal), 0x81);
  EXPECT_EQ(fp8::decode(0x01, s.dtype), s.min_subnormal);
  EXPECT_EQ(code_of(1.0), s.bias << s.mantissa_bits);  // 1.0 = 2^0: exponent field = bias
  EXPECT_EQ(code_of(-2.0), 0x80 | ((s.bias + 1) << s.mantissa_bits));
}

TEST(Fp8Named, E4M3AndE5M2CodesFromTheSpecTable) {
  // OFP8 table of the formats' special values, written out.
  EXPECT_EQ(fp8::encode(448.0f, DType::e4m3), 0x7E);
  EXPECT_EQ(fp8::encode(0.015625f, DType::e4m3), 0x08);
  EXPECT_EQ(fp8::encode(0.001953125f, DType::e4m3), 0x01);
  EXPECT_EQ(fp8::encode(57344.0f, DType::e5m2), 0x7B);
  EXPECT_EQ(fp8::encode(0x1p-14f, DType::e5m2), 0x04);
  EXPECT_EQ(fp8::encode(0x1p-16f, DType::e5m2), 0x01);
  EXPECT_EQ(fp8::decode(0x7C, DType::e5m2), std::numeric_limits<float>::infinity());
  EXPECT_EQ(fp8::decode(0xFC, DType::e5m2), -std::numeric_limits<float>::infinity());
  // 0x7E in E4M3 is S.1111.110 = 1.75 · 2^8: E = 15 is an ordinary exponent there.
  EXPECT_EQ(fp8::decode(0x78, DType::e4m3), 256.0f);
  EXPECT_TRUE(std::isnan(fp8::decode(0x7F, DType::e4m3)));
  for (unsigned c : {0x7Du, 0x7Eu, 0x7Fu, 0xFDu, 0xFEu, 0xFFu})
    EXPECT_TRUE(std::isnan(fp8::decode(static_cast<std::uint8_t>(c), DType::e5m2))) << hex(c);
  EXPECT_THROW(fp8::encode(1.0f, DType::bf16), Error);
  EXPECT_THROW(fp8::max_normal(DType::f32), Error);
}

// ---------------------------------------------------------------------------------------------
// Rounding, saturation, NaN, zero.
// ---------------------------------------------------------------------------------------------

TEST_P(Fp8Format, MidpointsBetweenAdjacentCodesGoToTheEvenCode) {
  const Spec& s = GetParam();
  for (unsigned c = 0; c < s.max_code; ++c) {  // c and c + 1 both finite and positive
    const long double lo = spec_value(s, c), hi = spec_value(s, c + 1);
    const auto mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(static_cast<long double>(mid), (lo + hi) / 2) << "midpoints are fp32 values";
    const unsigned even = c % 2 == 0 ? c : c + 1;
    EXPECT_EQ(fp8::encode(mid, s.dtype), even) << "midpoint of " << hex(c) << ", " << hex(c + 1);
    EXPECT_EQ(fp8::encode(-mid, s.dtype), 0x80 | even) << "-midpoint of " << hex(c);
    // One fp32 ulp either side decides for the nearer code.
    const float above = std::nextafter(mid, INFINITY), below = std::nextafter(mid, 0.0f);
    EXPECT_EQ(fp8::encode(above, s.dtype), c + 1) << "just above midpoint of " << hex(c);
    EXPECT_EQ(fp8::encode(below, s.dtype), c) << "just below midpoint of " << hex(c);
    EXPECT_EQ(fp8::encode(-above, s.dtype), 0x80 | (c + 1)) << "-just above, " << hex(c);
  }
}

TEST(Fp8Rounding, HandPickedTiesAndBoundaries) {
  const DType e4 = DType::e4m3, e5 = DType::e5m2;
  // E4M3 steps are 1/8 in [1, 2): 1.0625 lies halfway between 1 (0x38, even) and 1.125 (0x39).
  EXPECT_EQ(fp8::encode(1.0625f, e4), 0x38);
  EXPECT_EQ(fp8::encode(1.1875f, e4), 0x3A);  // between 1.125 (0x39) and 1.25 (0x3A, even)
  EXPECT_EQ(fp8::encode(3.25f, e4), 0x45);    // 3.25 = 1.625 · 2: exact, odd mantissa kept
  EXPECT_EQ(fp8::encode(3.375f, e4), 0x46);   // between 3.25 (0x45) and 3.5 (0x46, even)
  EXPECT_EQ(fp8::encode(200.0f, e4), 0x74);   // between 192 (0x74, even) and 208 (0x75)
  EXPECT_EQ(fp8::encode(216.0f, e4), 0x76);   // between 208 (0x75) and 224 (0x76, even)
  // Subnormal E4M3 steps are 2^-9.
  EXPECT_EQ(fp8::encode(0x1p-10f, e4), 0x00);         // half the min subnormal: tie to 0
  EXPECT_EQ(fp8::encode(0x1.000002p-10f, e4), 0x01);  // a hair above it
  EXPECT_EQ(fp8::encode(0x1.fffffep-11f, e4), 0x00);  // a hair below it
  EXPECT_EQ(fp8::encode(-0x1p-10f, e4), 0x80);
  EXPECT_EQ(fp8::encode(1.5f * 0x1p-9f, e4), 0x02);  // between 0x01 and 0x02 (even)
  EXPECT_EQ(fp8::encode(2.5f * 0x1p-9f, e4), 0x02);  // between 0x02 (even) and 0x03
  EXPECT_EQ(fp8::encode(7.5f * 0x1p-9f, e4), 0x08);  // largest subnormal to min normal: 0x08
  EXPECT_EQ(fp8::encode(6.5f * 0x1p-9f, e4), 0x06);
  // E5M2 steps are 1/4 in [1, 2).
  EXPECT_EQ(fp8::encode(1.125f, e5), 0x3C);  // between 1 (0x3C, even) and 1.25 (0x3D)
  EXPECT_EQ(fp8::encode(1.375f, e5), 0x3E);  // between 1.25 (0x3D) and 1.5 (0x3E, even)
  EXPECT_EQ(fp8::encode(0x1p-17f, e5), 0x00);
  EXPECT_EQ(fp8::encode(3.0f * 0x1p-17f, e5), 0x02);
  EXPECT_EQ(fp8::encode(3.5f * 0x1p-16f, e5), 0x04);  // largest subnormal to min normal
}

TEST_P(Fp8Format, LargeValuesAndInfinitiesSaturateToMax) {
  const Spec& s = GetParam();
  const long double ulp_at_max = spec_value(s, s.max_code) - spec_value(s, s.max_code - 1u);
  const auto past_max = static_cast<float>(s.max + ulp_at_max / 2);  // would round away from max
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {static_cast<float>(s.max), std::nextafter(static_cast<float>(s.max), inf),
                  past_max, std::nextafter(past_max, inf), static_cast<float>(s.max * 1.01),
                  static_cast<float>(2 * s.max), 1e30f, FLT_MAX, inf}) {
    EXPECT_EQ(fp8::encode(v, s.dtype), s.max_code) << v;
    EXPECT_EQ(fp8::encode(-v, s.dtype), 0x80 | s.max_code) << -v;
  }
}

TEST_P(Fp8Format, NaNStaysNaNWithItsSign) {
  const Spec& s = GetParam();
  for (std::uint32_t u : {0x7FC00000u, 0x7F800001u, 0x7FBFFFFFu, 0x7FFFFFFFu, 0x7FA00000u}) {
    EXPECT_EQ(fp8::encode(from_bits(u), s.dtype), s.nan_out) << std::hex << u;
    EXPECT_EQ(fp8::encode(from_bits(u | 0x80000000u), s.dtype), 0x80 | s.nan_out) << std::hex << u;
  }
  EXPECT_TRUE(is_nan_code(s, s.nan_out));
}

TEST_P(Fp8Format, NegativeZeroStaysNegative) {
  const Spec& s = GetParam();
  EXPECT_EQ(fp8::encode(0.0f, s.dtype), 0x00);
  EXPECT_EQ(fp8::encode(-0.0f, s.dtype), 0x80);
  const float below_half_step = static_cast<float>(s.min_subnormal / 2.5);
  for (float v : {std::numeric_limits<float>::denorm_min(), FLT_MIN, 1e-30f, below_half_step}) {
    EXPECT_EQ(fp8::encode(v, s.dtype), 0x00) << v;
    EXPECT_EQ(fp8::encode(-v, s.dtype), 0x80) << -v;
  }
  const float z = fp8::decode(0x80, s.dtype);
  EXPECT_EQ(z, 0.0f);
  EXPECT_TRUE(std::signbit(z));
}

// ---------------------------------------------------------------------------------------------
// The sweep of fp32 bit patterns.
// ---------------------------------------------------------------------------------------------

/// All 2^32 patterns (about a minute per format in a release build) with TPX_FP8_EXHAUSTIVE=1: the
/// ctest entry fp8.exhaustive, label `exhaustive`, outside the presets' suite. The stratified
/// sweep below otherwise (a fraction of a second).
bool exhaustive() {
  static const bool on = [] {
    const char* v = std::getenv("TPX_FP8_EXHAUSTIVE");
    return v != nullptr && std::string_view(v) == "1";
  }();
  return on;
}

/// Calls f(u) for the positive fp32 patterns u of the sweep, in increasing order (up to +inf).
/// Exhaustive: all of them. Stratified: for every exponent (subnormals, inf included) and every
/// value of the top 11 mantissa bits, 12 choices of the low 12 bits. An FP8 cast keeps at most
/// the top 3 of fp32's 23 mantissa bits (fewer for FP8 subnormals), rounds on the bit below the
/// last one kept, and breaks a tie on whether any bit further down is set. So the top 11 bits
/// take every combination of kept and rounding bits at every exponent, and the low choices put
/// the value on a midpoint or a code (0x000, when the bits above say so), one ulp above it
/// (0x001), one ulp below the next (0xFFF), and in between.
template <class F>
void for_each_sweep_pattern(F&& f) {
  if (exhaustive()) {
    for (std::uint32_t u = 0; u <= 0x7F800000u; ++u) f(u);
    return;
  }
  static constexpr std::uint32_t kLow[] = {0x000, 0x001, 0x002, 0x0FF, 0x3FF, 0x400,
                                           0x7FF, 0x800, 0x801, 0xBFF, 0xFFE, 0xFFF};
  for (std::uint32_t high = 0; high < (0x7F800000u >> 12); ++high)
    for (std::uint32_t low : kLow) f(high << 12 | low);
  f(0x7F800000u);
}

/// Sweeps the patterns, both signs, against a reference that walks the number line: it keeps
/// the pair of adjacent codes whose values bracket |v| and picks the nearer by long double
/// distance, the even code on a tie, max once |v| is past it. Now and then it also asks
/// nearest_code(), which searches all 256 codes.
void sweep(const Spec& s) {
  const std::uint64_t kCrossCheckEvery = exhaustive() ? 1u << 17 : 1u << 9;
  std::vector<long double> values;  // the positive finite values, index = code, increasing
  for (unsigned c = 0; c <= s.max_code; ++c) values.push_back(spec_value(s, c));
  ASSERT_TRUE(std::is_sorted(values.begin(), values.end()));
  std::size_t k = 0;  // values[k] <= |v| < values[k + 1]
  std::uint64_t checked = 0, wrong = 0, walker_wrong = 0;
  std::string first_errors;
  const auto report = [&](std::uint32_t u, unsigned got, unsigned want) {
    if (++wrong <= 8)
      first_errors +=
          fmt::format("\n  {:#010x} ({}) -> {} (want {})", u, from_bits(u), hex(got), hex(want));
  };
  const auto start = std::chrono::steady_clock::now();
  for_each_sweep_pattern([&](std::uint32_t u) {
    const long double a = from_bits(u);
    while (k + 1 < values.size() && values[k + 1] <= a) ++k;
    unsigned want;
    if (k + 1 == values.size()) {
      want = s.max_code;  // at or past max, +inf included
    } else {
      const long double below = a - values[k], above = values[k + 1] - a;
      want = below < above ? unsigned(k) : above < below ? unsigned(k + 1) : unsigned(k + 1) & ~1u;
    }
    if (checked % kCrossCheckEvery == 0 && nearest_code(s, from_bits(u)) != want) ++walker_wrong;
    const unsigned got = fp8::encode(from_bits(u), s.dtype);
    if (got != want) report(u, got, want);
    const unsigned got_neg = fp8::encode(from_bits(u | 0x80000000u), s.dtype);
    if (got_neg != (0x80u | want)) report(u | 0x80000000u, got_neg, 0x80u | want);
    checked += 2;
  });
  // The NaN patterns, both signs: all of them, or every 4093rd when stratified.
  for (std::uint32_t u = 0x7F800001u; u > 0x7F800000u && u <= 0x7FFFFFFFu;
       u += exhaustive() ? 1 : 4093) {
    for (std::uint32_t pattern : {u, u | 0x80000000u}) {
      const unsigned got = fp8::encode(from_bits(pattern), s.dtype);
      const unsigned want = (pattern >> 24 & 0x80u) | s.nan_out;
      if (got != want) report(pattern, got, want);
      ++checked;
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(walker_wrong, 0u) << "the walking reference disagrees with the brute-force one";
  EXPECT_EQ(wrong, 0u) << wrong << " of " << checked << " patterns wrong:" << first_errors;
  const std::string what = fmt::format("{} {} fp32 patterns in {:.1f} s", s.name, checked, seconds);
  ::testing::Test::RecordProperty(exhaustive() ? "exhaustive" : "stratified", what);
  std::printf("[          ] %s sweep: %s\n", exhaustive() ? "exhaustive" : "stratified",
              what.c_str());
  if (exhaustive()) {
    EXPECT_EQ(checked, std::uint64_t{1} << 32);
  }
}

TEST_P(Fp8Format, SweepOfFp32PatternsMatchesTheReference) {
  sweep(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8Format, ::testing::Values(kE4M3, kE5M2), format_name);

// ---------------------------------------------------------------------------------------------
// The ops on cpu tensors.
// ---------------------------------------------------------------------------------------------

Tensor host_f32(const std::vector<float>& values) {
  Tensor t = Tensor::empty({I(values.size())});
  std::copy(values.begin(), values.end(), t.f32().begin());
  return t;
}

Tensor host_scalar(float v) {
  return host_f32({v});
}

std::vector<std::uint8_t> codes_of(const Tensor& q) {
  const auto* p = q.data<std::uint8_t>();
  return {p, p + q.numel()};
}

TEST(Fp8Ops, QuantizeRoundsTheFp32ProductOfValueAndScale) {
  const std::vector<float> x = {1.0f, -0.5f, 0.1f, 1000.0f, NAN, -NAN, -0.0f, INFINITY, -INFINITY};
  Tensor q = Tensor::empty({I(x.size())}, DType::e4m3);
  ops::quantize_fp8(host_f32(x), host_scalar(2.0f), q);
  // 2 = 0.1000.000; −1 = 1.0111.000; 0.2 = 1.6 · 2^−3 -> 1.625 · 2^−3 = 0.0100.101; 2000 saturates.
  const std::vector<std::uint8_t> want = {0x40, 0xB8, 0x25, 0x7E, 0x7F, 0xFF, 0x80, 0x7E, 0xFE};
  EXPECT_EQ(codes_of(q), want);

  // The product is rounded to fp32 before the cast: (1 + 2^−23) · (1.0625 − 2^−23) is
  // 1.0625 + 2^−27 − 2^−46, which fp32 rounds to 1.0625, a tie that goes to 1.0 (0x38); the exact
  // product lies above the tie and would give 1.125 (0x39).
  const float a = 1.0f + 0x1p-23f, s = 1.0625f - 0x1p-23f;
  ASSERT_GT(static_cast<long double>(a) * s, 1.0625L);
  ASSERT_EQ(a * s, 1.0625f);
  Tensor q1 = Tensor::empty({1}, DType::e4m3);
  ops::quantize_fp8(host_f32({a}), host_scalar(s), q1);
  EXPECT_EQ(codes_of(q1)[0], 0x38);

  // E5M2 too, and scales that are not powers of two: each element is the cast of fl(x · scale).
  std::mt19937 gen(7);
  std::normal_distribution<float> dist(0.0f, 30.0f);
  std::vector<float> many(1000);
  for (float& v : many) v = dist(gen);
  for (const Spec* spec : {&kE4M3, &kE5M2}) {
    for (float scale : {0.37f, 3.0f, 1234.5f}) {
      Tensor qs = Tensor::empty({I(many.size())}, spec->dtype);
      ops::quantize_fp8(host_f32(many), host_scalar(scale), qs);
      const auto got = codes_of(qs);
      for (std::size_t i = 0; i < many.size(); ++i)
        ASSERT_EQ(got[i], nearest_code(*spec, many[i] * scale))
            << spec->name << " x = " << many[i] << ", scale " << scale;
    }
  }
}

TEST(Fp8Ops, DequantizeDividesTheDecodedValueByTheScale) {
  std::vector<std::uint8_t> all(256);
  for (unsigned c = 0; c < 256; ++c) all[c] = static_cast<std::uint8_t>(c);
  for (const Spec* spec : {&kE4M3, &kE5M2}) {
    Tensor q = Tensor::empty({256}, spec->dtype);
    std::copy(all.begin(), all.end(), q.data<std::uint8_t>());
    for (float scale : {1.0f, 3.0f, 0.1f, 448.0f / 7.3f, 1e-30f}) {
      Tensor x = Tensor::empty({256});
      ops::dequantize_fp8(q, host_scalar(scale), x);
      int differs_from_reciprocal = 0;
      for (unsigned c = 0; c < 256; ++c) {
        const long double value = spec_value(*spec, c);
        const float got = x.f32()[c];
        if (std::isnan(value)) {
          EXPECT_TRUE(std::isnan(got)) << spec->name << " " << hex(c);
          continue;
        }
        const float want = static_cast<float>(value) / scale;
        EXPECT_EQ(bits(got), bits(want)) << spec->name << " " << hex(c) << " / " << scale;
        if (want != static_cast<float>(value) * (1.0f / scale)) ++differs_from_reciprocal;
      }
      // With 3 some codes tell a division from a multiplication by 1/3.
      if (scale == 3.0f) {
        EXPECT_GT(differs_from_reciprocal, 0) << spec->name;
      }
    }
  }
}

// NaN through the scaling (common/fp8_bits.h, "NaN through the scaling"): the OFP8 formats have
// NaNs of both signs, and quantize and dequantize keep the sign and write one NaN per sign,
// whatever the scale and the NaN's payload. This is the class on which a GPU's fp32 arithmetic
// (canonical NaN 0x7FFFFFFF, sign dropped) and x86's (operand's NaN, sign kept) differ, so the
// casts must not leave it to the multiplication or division; pinned here bit for bit.
TEST(Fp8Ops, NaNKeepsItsSignThroughQuantizeAndDequantize) {
  const std::uint32_t nans[] = {0x7FC00000u, 0x7F800001u, 0x7FFFFFFFu, 0x7FA5A5A5u, 0x7FC00001u};
  const float scales[] = {1.0f, 0.37f, 1e-3f, 3e4f, 1e-30f, FLT_MAX, 0x1p-149f};
  for (const Spec* spec : {&kE4M3, &kE5M2}) {
    const fp8::Format f = fp8::format(spec->dtype);
    for (const float scale : scales) {
      for (const std::uint32_t u : nans)
        for (const std::uint32_t sign : {0u, 0x80000000u}) {
          const unsigned want = (sign >> 24) | spec->nan_out;
          EXPECT_EQ(fp8::quantize(from_bits(u | sign), scale, f), want)
              << spec->name << " " << std::hex << (u | sign) << " scale " << scale;
          Tensor q = Tensor::empty({1}, spec->dtype);
          ops::quantize_fp8(host_f32({from_bits(u | sign)}), host_scalar(scale), q);
          EXPECT_EQ(codes_of(q)[0], want) << spec->name << " " << std::hex << (u | sign);
        }
      // Every NaN code: fp32's quiet NaN with the code's sign, exactly.
      for (unsigned c = 0; c < 256; ++c) {
        if (!is_nan_code(*spec, c)) continue;
        const std::uint32_t want = (c & 0x80u ? 0x80000000u : 0u) | 0x7FC00000u;
        EXPECT_EQ(bits(fp8::dequantize(static_cast<std::uint8_t>(c), scale, f)), want)
            << spec->name << " " << hex(c) << " / " << scale;
        Tensor q = Tensor::empty({1}, spec->dtype), x = Tensor::empty({1});
        q.data<std::uint8_t>()[0] = static_cast<std::uint8_t>(c);
        ops::dequantize_fp8(q, host_scalar(scale), x);
        EXPECT_EQ(bits(x.f32()[0]), want) << spec->name << " " << hex(c) << " / " << scale;
      }
    }
  }
}

// The other special classes through the scaling, for the record: ±inf saturates to ±max in
// both formats (E5M2 has infinities, but the recipe saturates), −0 stays −0, an fp32 subnormal
// is scaled exactly (no flush to zero) before the cast, and the infinities decode back to ±inf.
TEST(Fp8Ops, InfinitiesZerosAndSubnormalsThroughTheScaling) {
  for (const Spec* spec : {&kE4M3, &kE5M2}) {
    const fp8::Format f = fp8::format(spec->dtype);
    for (const float scale : {1.0f, 0.37f, 1e-30f, FLT_MAX}) {
      EXPECT_EQ(fp8::quantize(INFINITY, scale, f), spec->max_code) << spec->name;
      EXPECT_EQ(fp8::quantize(-INFINITY, scale, f), 0x80 | spec->max_code) << spec->name;
      EXPECT_EQ(fp8::quantize(-0.0f, scale, f), 0x80) << spec->name;
      EXPECT_EQ(bits(fp8::dequantize(0x80, scale, f)), 0x80000000u) << spec->name;
    }
    // 1.5·2^−135 (an fp32 subnormal) times 2^125 is 1.5·2^−10, exact, then cast.
    const float sub = 0x1.8p-135f, scale = 0x1p125f;
    ASSERT_EQ(bits(sub) >> 23, 0u) << "an fp32 subnormal";
    EXPECT_EQ(fp8::quantize(sub, scale, f), nearest_code(*spec, 0x1.8p-10f)) << spec->name;
    EXPECT_NE(fp8::quantize(sub, scale, f), 0) << spec->name;
    // A code divided by a huge scale: an fp32 subnormal quotient, not flushed.
    const float back = fp8::dequantize(0x38, FLT_MAX, fp8::kE4M3);
    EXPECT_EQ(bits(back), bits(1.0f / FLT_MAX)) << "1 / FLT_MAX";
  }
  EXPECT_EQ(bits(fp8::dequantize(0x7C, 3.0f, fp8::kE5M2)), 0x7F800000u);  // +inf / 3
  EXPECT_EQ(bits(fp8::dequantize(0xFC, 3.0f, fp8::kE5M2)), 0xFF800000u);  // −inf / 3
}

float amax_of(const std::vector<float>& values) {
  Tensor out = Tensor::empty({1});
  ops::amax(host_f32(values), out);
  return out.f32()[0];
}

TEST(Fp8Ops, AmaxIsTheLargestMagnitudeAndPropagatesNaN) {
  EXPECT_EQ(amax_of({1.0f, -7.5f, 3.0f, -0.0f}), 7.5f);
  EXPECT_EQ(amax_of({0.25f}), 0.25f);
  EXPECT_EQ(amax_of({2.0f, -INFINITY, 1.0f}), INFINITY);
  EXPECT_EQ(bits(amax_of({-0.0f, -0.0f})), 0u);  // +0: |−0|
  EXPECT_EQ(bits(amax_of({})), 0u);
  for (std::size_t where : {0, 2, 4}) {
    std::vector<float> v = {1.0f, -2.0f, INFINITY, 3.0f, 4.0f};
    v[where] = -NAN;
    EXPECT_EQ(bits(amax_of(v)), 0x7FC00000u) << "NaN at " << where;  // canonical, positive
  }
}

float scale_of(float amax, DType fmt) {
  Tensor scale = Tensor::empty({1});
  ops::fp8_scale(host_scalar(amax), fmt, scale);
  return scale.f32()[0];
}

TEST(Fp8Ops, ScaleIsFmaxOverAmaxWithOneForZeroInfAndNaN) {
  EXPECT_EQ(bits(scale_of(7.5f, DType::e4m3)), bits(448.0f / 7.5f));
  EXPECT_EQ(bits(scale_of(7.5f, DType::e5m2)), bits(57344.0f / 7.5f));
  EXPECT_EQ(bits(scale_of(0.3f, DType::e4m3)), bits(448.0f / 0.3f));
  EXPECT_EQ(scale_of(448.0f, DType::e4m3), 1.0f);
  EXPECT_EQ(scale_of(0.0f, DType::e4m3), 1.0f);
  EXPECT_EQ(scale_of(INFINITY, DType::e4m3), 1.0f);
  EXPECT_EQ(scale_of(NAN, DType::e5m2), 1.0f);
  // 448 / 1e−38 overflows fp32: the scale is FLT_MAX, not inf (which would turn 0 into NaN).
  EXPECT_EQ(scale_of(1e-38f, DType::e4m3), FLT_MAX);
  EXPECT_EQ(scale_of(std::numeric_limits<float>::denorm_min(), DType::e5m2), FLT_MAX);
  EXPECT_THROW(scale_of(1.0f, DType::bf16), Error);
}

TEST(Fp8Ops, ScaledTensorRoundTripsWithinHalfAStep) {
  std::mt19937 gen(3);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> values(4096);
  for (float& v : values) v = dist(gen);
  const Tensor x = host_f32(values);
  for (const Spec* spec : {&kE4M3, &kE5M2}) {
    Tensor amax = Tensor::empty({1}), scale = Tensor::empty({1});
    Tensor q = Tensor::empty({I(values.size())}, spec->dtype), back = Tensor::empty(x.shape());
    ops::amax(x, amax);
    ops::fp8_scale(amax, spec->dtype, scale);
    ops::quantize_fp8(x, scale, q);
    ops::dequantize_fp8(q, scale, back);
    const float s = scale.f32()[0];
    const double relative_half_step = std::ldexp(1.0, -(spec->mantissa_bits + 1));
    for (std::size_t i = 0; i < values.size(); ++i) {
      const double v = values[i], scaled = std::fabs(v * s);
      if (scaled < spec->min_normal) continue;  // subnormal steps are absolute, not relative
      EXPECT_LE(std::fabs(back.f32()[i] - v), relative_half_step * std::fabs(v) * 1.0001)
          << spec->name << " " << v;
      // The largest magnitude lands on ±max.
      if (std::fabs(values[i]) == amax.f32()[0]) {
        EXPECT_EQ(codes_of(q)[i] & 0x7F, spec->max_code) << spec->name;
      }
    }
  }
}

TEST(Fp8Ops, RejectsTensorsThatDoNotFit) {
  const Tensor x = host_f32({1.0f, 2.0f});
  const Tensor q = Tensor::empty({2}, DType::e4m3);
  EXPECT_THROW(ops::quantize_fp8(x, host_scalar(1.0f), Tensor::empty({2})), Error);  // f32 q
  EXPECT_THROW(ops::quantize_fp8(x, host_f32({1.0f, 1.0f}), q), Error);  // scale of 2 elements
  EXPECT_THROW(ops::quantize_fp8(x, host_scalar(1.0f), Tensor::empty({3}, DType::e5m2)), Error);
  EXPECT_THROW(ops::dequantize_fp8(q, host_scalar(1.0f), Tensor::empty({2}, DType::e5m2)), Error);
  EXPECT_THROW(ops::amax(x, Tensor::empty({2})), Error);
}

// ---------------------------------------------------------------------------------------------
// cuda against cpu.
// ---------------------------------------------------------------------------------------------

/// Inputs for the device comparison: the stratified sweep's patterns, both signs, every NaN
/// class, and a scattering of random bit patterns.
std::vector<float> device_inputs() {
  std::vector<float> v;
  static constexpr std::uint32_t kLow[] = {0x000, 0x001, 0x7FF, 0x800, 0x801, 0xFFF};
  for (std::uint32_t high = 0; high <= (0x7FFFFFFFu >> 12); high += 3)
    for (std::uint32_t low : kLow) {
      v.push_back(from_bits(high << 12 | low));
      v.push_back(from_bits(0x80000000u | high << 12 | low));
    }
  std::mt19937 gen(11);
  for (int i = 0; i < 100000; ++i) v.push_back(from_bits(static_cast<std::uint32_t>(gen())));
  return v;
}

/// The bytes of any tensor, copied to the host.
std::vector<std::uint8_t> host_bytes(const Tensor& t) {
  Tensor host = Tensor::empty(t.shape(), t.dtype(), Device::cpu);
  ops::copy(t, host);
  const auto* p = static_cast<const std::uint8_t*>(host.raw());
  return {p, p + host.nbytes()};
}

// --- GEMMs of FP8 operands -----------------------------------------------------------------------

/// A [rows, cols] FP8 tensor of `fmt` with its scale, from values spread over a few binades.
Tensor scaled_fp8(std::int64_t rows, std::int64_t cols, DType fmt, float scale, float salt) {
  Tensor x = Tensor::empty({rows, cols});
  for (std::size_t i = 0; i < x.f32().size(); ++i)
    x.f32()[i] = std::sin(float(i) * 1.7f + salt) * std::exp2(float(i % 7) - 3.0f);
  const Tensor s = Tensor::empty({1});
  s.f32()[0] = scale;
  Tensor q = Tensor::empty({rows, cols}, fmt);
  ops::quantize_fp8(x, s, q);
  return q.with_scale(s);
}

TEST(Fp8Gemm, IsTheFp32GemmOfTheDequantizedOperands) {
  // The recipe's three products, every transpose, beta 0 and 1: C must equal, bit for bit, the
  // fp32 GEMM of q / scale computed here element by element from the codes (decode, divide).
  const std::int64_t m = 5, n = 6, k = 7;
  struct Combo {
    DType a, b;
  };
  for (const Combo combo : {Combo{DType::e4m3, DType::e4m3}, Combo{DType::e5m2, DType::e4m3},
                            Combo{DType::e4m3, DType::e5m2}})
    for (const bool ta : {false, true})
      for (const bool tb : {false, true})
        for (const float beta : {0.0f, 1.0f}) {
          SCOPED_TRACE(fmt::format("{} x {}, trans {} {}, beta {}", to_string(combo.a),
                                   to_string(combo.b), ta, tb, beta));
          const Tensor a = scaled_fp8(ta ? k : m, ta ? m : k, combo.a, 37.5f, 0.3f);
          const Tensor b = scaled_fp8(tb ? n : k, tb ? k : n, combo.b, 0.75f, 1.1f);
          auto dequantized = [](const Tensor& q) {
            Tensor x = Tensor::empty(q.shape());
            const float s = q.scale().f32()[0];
            for (std::size_t i = 0; i < x.f32().size(); ++i)
              x.f32()[i] = fp8::decode(q.data<std::uint8_t>()[i], q.dtype()) / s;
            return x;
          };
          Tensor want = Tensor::empty({m, n}), got = Tensor::empty({m, n});
          for (std::size_t i = 0; i < want.f32().size(); ++i) want.f32()[i] = got.f32()[i] = 0.5f;
          ops::gemm(dequantized(a), ta, dequantized(b), tb, want, 1.0f, beta);
          ops::gemm(a, ta, b, tb, got, 1.0f, beta);
          for (std::size_t i = 0; i < want.f32().size(); ++i)
            ASSERT_EQ(got.f32()[i], want.f32()[i]) << "element " << i;
        }
}

TEST(Fp8Gemm, NeedsBothOperandsInFp8WithTheirScales) {
  const Tensor a = scaled_fp8(2, 3, DType::e4m3, 1.0f, 0.0f);
  const Tensor c = Tensor::empty({2, 2});
  EXPECT_THROW(ops::gemm(a, false, Tensor::zeros({3, 2}), false, c), Error);  // fp32 B
  const Tensor unscaled = Tensor::empty({3, 2}, DType::e4m3);
  EXPECT_THROW(ops::gemm(a, false, unscaled, false, c), Error);  // no scale
}

TEST(Fp8Device, TheCpuAlwaysRunsFp8AndAGpuSaysWhyNot) {
  EXPECT_EQ(ops::fp8_problem(Device::cpu), "");
  const std::string why = ops::fp8_problem(Device::cuda);
  if (const std::string gpu = ops::device_problem(Device::cuda); !gpu.empty()) {
    EXPECT_EQ(why, gpu);  // no usable GPU: that is the reason
  } else if (!why.empty()) {
    EXPECT_NE(why.find("compute capability 8.9"), std::string::npos) << why;
    EXPECT_EQ(why.find('\n'), std::string::npos) << "one line: " << why;
  }
}

/// "" when the cast's outputs on the GPU and on the cpu are the same bytes; otherwise where they
/// first differ: the index, the input there (its bits and value: an fp32, or a code and what it
/// decodes to), both outputs (bits, and value for fp32) and the scale. Every comparison of the
/// test below goes through it, so a failure names the one value to look at.
std::string cast_mismatch(const Tensor& input, const Tensor& gpu, const Tensor& cpu, float scale) {
  const std::vector<std::uint8_t> in = host_bytes(input), g = host_bytes(gpu), c = host_bytes(cpu);
  if (g.size() != c.size())
    return fmt::format("{} bytes from the GPU, {} from the cpu", g.size(), c.size());
  const std::size_t w = gpu.dtype() == DType::f32 ? 4 : 1;
  auto word = [w](const std::vector<std::uint8_t>& v, std::size_t i) {
    std::uint32_t u = 0;
    std::memcpy(&u, v.data() + i * w, w);
    return u;
  };
  auto describe = [](DType t, std::uint32_t u) {
    if (t == DType::f32) return fmt::format("{:#010x} ({})", u, from_bits(u));
    return fmt::format("{:#04x} ({} {})", u, to_string(t),
                       fp8::decode(static_cast<std::uint8_t>(u), t));
  };
  const std::size_t wi = input.dtype() == DType::f32 ? 4 : 1;
  for (std::size_t i = 0; i < g.size() / w; ++i) {
    if (word(g, i) == word(c, i)) continue;
    std::uint32_t x = 0;
    std::memcpy(&x, in.data() + i * wi, wi);
    return fmt::format("element {} of {}: input {}, GPU {}, cpu {}, scale {} ({:#010x})", i,
                       g.size() / w, describe(input.dtype(), x), describe(gpu.dtype(), word(g, i)),
                       describe(cpu.dtype(), word(c, i)), scale, bits(scale));
  }
  return "";
}

TEST(Fp8Cuda, CastsEqualTheCpuCastsBitForBit) {
  TPX_REQUIRE_GPU();
  const std::vector<float> values = device_inputs();
  const I n = I(values.size()) / 4 * 4;  // a multiple of 4: the vector path
  const Tensor x = host_f32(values).slice0(0, n);
  const Tensor x_gpu = test::on_gpu(x);
  for (const Spec* spec : {&kE4M3, &kE5M2}) {
    for (float scale : {1.0f, 0.37f, 1e-3f, 3e4f, 1e-30f}) {
      SCOPED_TRACE(fmt::format("{}, scale {}", spec->name, scale));
      const Tensor s = host_scalar(scale), s_gpu = test::on_gpu(s);
      Tensor q = Tensor::empty({n}, spec->dtype), q_gpu = test::gpu_empty({n}, spec->dtype);
      ops::quantize_fp8(x, s, q);
      ops::quantize_fp8(x_gpu, s_gpu, q_gpu);
      EXPECT_EQ(cast_mismatch(x, q_gpu, q, scale), "") << "quantize";
      // Offset views of odd length: the scalar path.
      const Tensor xs = x.slice0(1, n - 2), qs = q.slice0(3, n), qs_gpu = q_gpu.slice0(3, n);
      ops::quantize_fp8(xs, s, qs);
      ops::quantize_fp8(test::on_gpu(xs), s_gpu, qs_gpu);
      EXPECT_EQ(cast_mismatch(xs, qs_gpu, qs, scale), "") << "quantize, scalar path";
      // Dequantize what was just quantized (every code occurs), both paths.
      Tensor back = Tensor::empty({n}), back_gpu = test::gpu_empty({n});
      ops::dequantize_fp8(q, s, back);
      ops::dequantize_fp8(q_gpu, s_gpu, back_gpu);
      EXPECT_EQ(cast_mismatch(q, back_gpu, back, scale), "") << "dequantize";
      const Tensor bs = back.slice0(1, n - 2), bs_gpu = back_gpu.slice0(1, n - 2);
      ops::dequantize_fp8(q.slice0(2, n - 1), s, bs);
      ops::dequantize_fp8(q_gpu.slice0(2, n - 1), s_gpu, bs_gpu);
      EXPECT_EQ(cast_mismatch(q.slice0(2, n - 1), bs_gpu, bs, scale), "")
          << "dequantize, scalar path";
    }
  }
}

TEST(Fp8Cuda, AmaxAndScaleEqualTheCpu) {
  TPX_REQUIRE_GPU();
  std::mt19937 gen(5);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (I n : {I{0}, I{1}, I{5}, I{1000}, I{1} << 20, (I{1} << 20) + 3}) {
    for (std::string_view plant : {"", "inf", "nan", "-0"}) {
      std::vector<float> v(static_cast<std::size_t>(n));
      for (float& e : v) e = dist(gen);
      if (n > 0 && plant == "inf") v[v.size() / 2] = -INFINITY;
      if (n > 0 && plant == "nan") v[v.size() - 1] = from_bits(0xFFA00001u);
      if (plant == "-0") std::fill(v.begin(), v.end(), -0.0f);
      for (I offset : {I{0}, I{1}}) {
        if (offset > n) continue;
        const Tensor x = host_f32(v).slice0(offset, n);
        Tensor a = Tensor::empty({1}), a_gpu = test::gpu_empty({1});
        ops::amax(x, a);
        ops::amax(test::on_gpu(x), a_gpu);
        EXPECT_EQ(host_bytes(a_gpu), host_bytes(a)) << "n " << n << " " << plant << " " << offset;
      }
    }
  }
  for (float amax : {0.0f, 1.0f, 7.5f, 0.3f, 1e-38f, 1e-45f, 3e38f, INFINITY, NAN}) {
    for (DType fmt : {DType::e4m3, DType::e5m2}) {
      Tensor s = Tensor::empty({1}), s_gpu = test::gpu_empty({1});
      ops::fp8_scale(host_scalar(amax), fmt, s);
      ops::fp8_scale(test::on_gpu(host_scalar(amax)), fmt, s_gpu);
      EXPECT_EQ(host_bytes(s_gpu), host_bytes(s)) << "amax " << amax;
    }
  }
}

}  // namespace
}  // namespace tpx
