// The cuda backend's element-wise kernels on bf16 tensors, checked without a GPU: the per-element
// functors the kernels run (common/cuda/elementwise_ops.h: RMSNorm's sweeps, RoPE, SwiGLU, add,
// the loss's gradient, fill, the optimizers' updates with their bf16 compute copy, and the load /
// store that widen and round) run here on the host over
// the same bf16 storage, through both the scalar one(i) and the vector four(i) paths, and must
// equal, bit for bit, the cpu backend's result through tpx::ops' Fp32Boundary (bf16 inputs
// widened into fp32 copies, the fp32 op, each output rounded once). So reading bf16 in registers
// and rounding once in the store keeps exactly the recipe's rounding points. Inputs are random
// bf16 values with ±0, subnormals, ±inf, NaN and sums that fall on a tie between two bf16 values.
//
// Each comparison is shown to be able to fail: the same functor with one extra rounding (an
// intermediate rounded to bf16, a rounding point that is not the recipe's) differs.
//
// What only a GPU can confirm: that nvcc compiles these functors to the same values (the device's
// expf, FMA contraction where the functors leave it allowed); tests/test_cuda_ops.cc does that.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/cuda/elementwise_ops.h"
#include "common/ops.h"
#include "common/rope.h"
#include "common/tensor.h"
#include "test_util.h"

namespace tpx {
namespace {

namespace elem = cuda::elem;
using I = std::int64_t;
using u16 = std::uint16_t;

constexpr I kN = 4096;

/// bf16 values: the specials and ties first, then random normal values of assorted scales and
/// random bit patterns (which cover every exponent, subnormals and NaN payloads included).
std::vector<u16> bf16_values(I n, std::uint32_t seed) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<u16> v = {bf16_bits(0.0f),
                        bf16_bits(-0.0f),
                        bf16_bits(inf),
                        bf16_bits(-inf),
                        0x7fc0,
                        0xffc1,  // NaNs
                        0x0001,
                        0x8003,
                        0x007f,  // subnormals
                        bf16_bits(1.0f),
                        bf16_bits(0x1p-8f),
                        bf16_bits(1.0f + 0x1p-7f),
                        bf16_bits(3 * 0x1p-8f),
                        bf16_bits(-1.0f),
                        bf16_bits(0x1p-133f),
                        bf16_bits(0x1.fep127f),
                        bf16_bits(0x1p-126f)};
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> scale(-20, 20);
  while (I(v.size()) < n) {
    if (rng() % 4 == 0)
      v.push_back(static_cast<u16>(rng()));
    else
      v.push_back(bf16_bits(std::ldexp(normal(rng), scale(rng))));
  }
  v.resize(static_cast<std::size_t>(n));
  return v;
}

Tensor bf16_tensor(const std::vector<u16>& bits, Tensor::Shape shape) {
  Tensor t = Tensor::empty(std::move(shape), DType::bf16);
  std::copy(bits.begin(), bits.end(), t.data<u16>());
  return t;
}
Tensor f32_tensor(I n, std::uint32_t seed) {
  Tensor t = Tensor::empty({n});
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : t.f32()) x = normal(rng);
  t.f32()[0] = 1.0f + 0x1p-9f;  // not a bf16 value: rounded if it were widened from bf16
  return t;
}

/// The first element whose bits differ, or "". Any two NaNs count as equal: which NaN an
/// operation on NaNs gives (sign, payload) depends on the order the compiler puts the operands in,
/// and the GPU makes every NaN its canonical one; the rounding of numbers is what is checked.
std::string first_difference(const Tensor& got, const Tensor& want) {
  for (I i = 0; i < got.numel(); ++i) {
    float g, w;
    std::uint32_t gb, wb;
    if (got.dtype() == DType::bf16) {
      g = bf16_value(got.data<u16>()[i]);
      w = bf16_value(want.data<u16>()[i]);
    } else {
      g = got.data<float>()[i];
      w = want.data<float>()[i];
    }
    gb = std::bit_cast<std::uint32_t>(g);
    wb = std::bit_cast<std::uint32_t>(w);
    if (gb != wb && !(std::isnan(g) && std::isnan(w)))
      return "element " + std::to_string(i) + ": " + std::to_string(g) + " vs " + std::to_string(w);
  }
  return "";
}
/// Bit-equal doubles, or two NaNs.
bool same(double a, double b) {
  return std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b) ||
         (std::isnan(a) && std::isnan(b));
}

/// Runs a functor over n elements the way the kernels do: the vector path (four(i), n / 4
/// groups) or the scalar path (one(i)).
template <class Op>
void run(const Op& op, I n, bool vec) {
  if (vec)
    for (I i = 0; i < n / 4; ++i) op.four(i);
  else
    for (I i = 0; i < n; ++i) op.one(i);
}

Tensor like(const Tensor& t) {
  return Tensor::empty(t.shape(), t.dtype());
}

/// x rounded to bf16 and widened back: the extra rounding of the negative checks.
float r16(float x) {
  return elem::widen(elem::round_bf16(x));
}

template <class T>
T* ptr(const Tensor& t) {
  return t.data<T>();
}

TEST(CudaTwins, StorageWidensExactlyAndRoundsToNearestEven) {
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const auto bits = static_cast<u16>(b);
    ASSERT_EQ(std::bit_cast<std::uint32_t>(elem::widen(bits)),
              std::bit_cast<std::uint32_t>(bf16_value(bits)));
  }
  // Every 65537th fp32 pattern (all exponents, both signs), and the ties around 1.
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 65537) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(u));
    ASSERT_EQ(elem::round_bf16(x), bf16_bits(x)) << std::hex << u;
  }
  EXPECT_EQ(elem::round_bf16(1.0f + 0x1p-8f), 0x3f80);
  EXPECT_EQ(elem::round_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
}

TEST(CudaTwins, AddMatchesTheCpuBoundary) {
  const Tensor a = bf16_tensor(bf16_values(kN, 1), {kN});
  std::vector<u16> bs = bf16_values(kN, 2);
  // Against a's first values (bf16_values): 0 + −0, inf + −inf, and two sums on a tie:
  // 1 + 2^-8 rounds to 1, (1 + 2^-7) + 2^-8 up to 1 + 2^-6.
  bs[0] = bf16_bits(-0.0f);
  bs[2] = bf16_bits(-std::numeric_limits<float>::infinity());
  bs[9] = bf16_bits(0x1p-8f);
  bs[11] = bf16_bits(0x1p-8f);
  const Tensor b = bf16_tensor(bs, {kN});
  const Tensor f = f32_tensor(kN, 3);
  for (const bool vec : {false, true}) {
    SCOPED_TRACE(vec ? "vector path" : "scalar path");
    // bf16 + bf16 -> bf16, f32 + bf16 -> bf16, bf16 + bf16 -> f32.
    Tensor want = like(a), got = like(a);
    ops::add(a, b, want);
    run(elem::Add<u16, u16, u16>{ptr<u16>(a), ptr<u16>(b), ptr<u16>(got)}, kN, vec);
    EXPECT_EQ(first_difference(got, want), "") << "bf16 + bf16";

    ops::add(f, b, want);
    run(elem::Add<float, u16, u16>{ptr<float>(f), ptr<u16>(b), ptr<u16>(got)}, kN, vec);
    EXPECT_EQ(first_difference(got, want), "") << "f32 + bf16";

    Tensor want32 = Tensor::empty({kN}), got32 = Tensor::empty({kN});
    ops::add(a, b, want32);
    run(elem::Add<u16, u16, float>{ptr<u16>(a), ptr<u16>(b), ptr<float>(got32)}, kN, vec);
    EXPECT_EQ(first_difference(got32, want32), "") << "bf16 + bf16 -> f32";

    // In place (accumulate): into = into + x.
    Tensor into = like(a), into_want = like(a);
    ops::copy(b, into);
    ops::copy(b, into_want);
    ops::accumulate(a, into_want);
    run(elem::Add<u16, u16, u16>{ptr<u16>(into), ptr<u16>(a), ptr<u16>(into)}, kN, vec);
    EXPECT_EQ(first_difference(into, into_want), "") << "accumulate";
  }
  // A wrong rounding point is seen: the f32 operand rounded to bf16 before the sum.
  Tensor want = like(a), wrong = like(a);
  ops::add(f, b, want);
  for (I i = 0; i < kN; ++i)
    elem::store(ptr<u16>(wrong), i, r16(elem::load(ptr<float>(f), i)) + elem::load(ptr<u16>(b), i));
  EXPECT_NE(first_difference(wrong, want), "");
}

TEST(CudaTwins, SwigluMatchesTheCpuBoundary) {
  const Tensor gate = bf16_tensor(bf16_values(kN, 4), {kN}),
               up = bf16_tensor(bf16_values(kN, 5), {kN});
  const Tensor dout = bf16_tensor(bf16_values(kN, 6), {kN});
  for (const bool vec : {false, true}) {
    SCOPED_TRACE(vec ? "vector path" : "scalar path");
    Tensor want = like(gate), got = like(gate);
    ops::swiglu_forward(gate, up, want);
    run(elem::SwigluForward<u16, u16>{ptr<u16>(gate), ptr<u16>(up), ptr<u16>(got)}, kN, vec);
    EXPECT_EQ(first_difference(got, want), "") << "forward";

    Tensor want32 = Tensor::empty({kN}), got32 = Tensor::empty({kN});
    ops::swiglu_forward(gate, up, want32);
    run(elem::SwigluForward<u16, float>{ptr<u16>(gate), ptr<u16>(up), ptr<float>(got32)}, kN, vec);
    EXPECT_EQ(first_difference(got32, want32), "") << "forward -> f32";

    Tensor wdg = like(gate), wdu = like(gate), gdg = like(gate), gdu = like(gate);
    ops::swiglu_backward(dout, gate, up, wdg, wdu);
    run(elem::SwigluBackward<u16, u16>{ptr<u16>(dout), ptr<u16>(gate), ptr<u16>(up), ptr<u16>(gdg),
                                       ptr<u16>(gdu)},
        kN, vec);
    EXPECT_EQ(first_difference(gdg, wdg), "") << "dgate";
    EXPECT_EQ(first_difference(gdu, wdu), "") << "dup";
  }
  // Wrong rounding points: silu(gate) rounded before the product with up; σ rounded in backward.
  Tensor want = like(gate), wrong = like(gate);
  ops::swiglu_forward(gate, up, want);
  for (I i = 0; i < kN; ++i) {
    const float g = elem::load(ptr<u16>(gate), i);
    elem::store(ptr<u16>(wrong), i, r16(g * elem::sigmoid(g)) * elem::load(ptr<u16>(up), i));
  }
  EXPECT_NE(first_difference(wrong, want), "");
  Tensor wdg = like(gate), wdu = like(gate);
  ops::swiglu_backward(dout, gate, up, wdg, wdu);
  for (I i = 0; i < kN; ++i) {
    const float d = elem::load(ptr<u16>(dout), i), g = elem::load(ptr<u16>(gate), i),
                u = elem::load(ptr<u16>(up), i), s = r16(elem::sigmoid(g));
    elem::store(ptr<u16>(wrong), i, d * u * s * (1.0f + g * (1.0f - s)));
  }
  EXPECT_NE(first_difference(wrong, wdg), "");
}

TEST(CudaTwins, LossGradientAndSumsMatchTheCpuBoundary) {
  // The recipe's loss: y bf16, the target fp32, dy bf16.
  const Tensor y = bf16_tensor(bf16_values(kN, 7), {kN});
  const Tensor t = f32_tensor(kN, 8);
  const double scale = 1.0 / 3000.0;
  for (const bool vec : {false, true}) {
    SCOPED_TRACE(vec ? "vector path" : "scalar path");
    Tensor want = like(y), got = like(y);
    ops::mse_loss_backward(y, t, scale, want);
    run(elem::MseBackward<u16, float, u16>{ptr<u16>(y), ptr<float>(t), scale, ptr<u16>(got)}, kN,
        vec);
    EXPECT_EQ(first_difference(got, want), "") << "mse_loss_backward";
  }
  // The sums of squares read the bf16 values exactly: the same terms, in double, as the cpu's.
  // (The kernels' summation order differs from the cpu's; the terms are what this checks.)
  double sum = 0.0, sq = 0.0;
  for (I i = 0; i < kN; ++i) {
    const double d = double(elem::load(ptr<u16>(y), i)) - double(elem::load(ptr<float>(t), i));
    sum += d * d;
    const double x = elem::load(ptr<u16>(y), i);
    sq += x * x;
  }
  const double want_sum = ops::mse_loss_sum(y, t), want_sq = ops::sum_squares(y);
  EXPECT_TRUE(same(sum, want_sum)) << sum << " vs " << want_sum;
  EXPECT_TRUE(same(sq, want_sq)) << sq << " vs " << want_sq;
  // And with finite values only, a number to compare bit for bit.
  sum = sq = 0.0;
  for (I i = 0; i < kN; ++i) {
    const float v = elem::load(ptr<u16>(y), i);
    if (std::isfinite(v)) sq += double(v) * v;
  }
  std::vector<u16> finite;
  for (I i = 0; i < kN; ++i)
    if (std::isfinite(elem::load(ptr<u16>(y), i))) finite.push_back(ptr<u16>(y)[i]);
  const Tensor yf = bf16_tensor(finite, {I(finite.size())});
  EXPECT_TRUE(same(sq, ops::sum_squares(yf))) << sq << " vs " << ops::sum_squares(yf);
  // Wrong rounding point: the difference rounded to bf16 before it is scaled.
  Tensor want = like(y), wrong = like(y);
  ops::mse_loss_backward(y, t, scale, want);
  for (I i = 0; i < kN; ++i)
    elem::store(ptr<u16>(wrong), i,
                static_cast<float>(scale * double(r16(elem::load(ptr<u16>(y), i) -
                                                      elem::load(ptr<float>(t), i)))));
  EXPECT_NE(first_difference(wrong, want), "");
}

TEST(CudaTwins, FillRoundsOnce) {
  Tensor want = Tensor::empty({kN}, DType::bf16), got = like(want);
  for (const float v : {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 0.1f, -0.0f, 0x1p-140f, 3.14159f}) {
    ops::fill(want, v);
    run(elem::Fill<u16>{ptr<u16>(got), v}, kN, true);
    EXPECT_EQ(first_difference(got, want), "") << v;
  }
}

// RMSNorm: the statistic is a reduction whose order differs between the kernels and the cpu
// (tests/test_cuda_ops.cc compares those within a tolerance); its per-element sweeps, given the
// statistic, are the functors here. They take the cpu's own rstd (and the cpu's mean for dx, made
// here as the cpu makes it) and must round as the cpu boundary does.
TEST(CudaTwins, RmsNormSweepsMatchTheCpuBoundary) {
  const I rows = 16, h = 256;
  std::vector<u16> xs = bf16_values(rows * h, 9);
  // Finite inputs: one inf in a row makes its whole output NaN, which would test little.
  for (u16& b : xs)
    if ((b & 0x7f80) == 0x7f80) b = bf16_bits(0.5f);
  const Tensor x = bf16_tensor(xs, {rows, h});
  std::vector<u16> dys = bf16_values(rows * h, 10);
  for (u16& b : dys)
    if ((b & 0x7f80) == 0x7f80) b = bf16_bits(-0.25f);
  const Tensor dy = bf16_tensor(dys, {rows, h});
  Tensor g = Tensor::empty({h});
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(1.0f, 0.1f);
  for (float& v : g.f32()) v = normal(rng);

  Tensor y = like(x), rstd = Tensor::empty({rows});
  ops::rmsnorm_forward(x, g, y, rstd);
  Tensor dx = like(x), dg = Tensor::empty({h});
  ops::rmsnorm_backward(dy, x, g, rstd, dx, dg);

  Tensor got = like(x), wrong = like(x);
  const auto* px = ptr<u16>(x);
  const auto* pdy = ptr<u16>(dy);
  const float* pg = ptr<float>(g);
  for (I r = 0; r < rows; ++r) {
    const float inv = rstd.f32()[std::size_t(r)];
    for (I i = 0; i < h; ++i) {
      const float xi = elem::load(px, r * h + i);
      elem::store(ptr<u16>(got), r * h + i, elem::rmsnorm_y(xi, inv, pg[i]));
      elem::store(ptr<u16>(wrong), r * h + i, r16(xi * inv) * pg[i]);
    }
  }
  EXPECT_EQ(first_difference(got, y), "") << "y";
  EXPECT_NE(first_difference(wrong, y), "") << "y with x·rstd rounded";

  for (I r = 0; r < rows; ++r) {
    const float inv = rstd.f32()[std::size_t(r)];
    double dot = 0.0;  // as the cpu: Σ dy·g·(x·rstd) in double
    for (I i = 0; i < h; ++i)
      dot += double(elem::load(pdy, r * h + i)) * pg[i] * (elem::load(px, r * h + i) * inv);
    const auto mean = static_cast<float>(dot / double(h));
    for (I i = 0; i < h; ++i) {
      const float d = elem::load(pdy, r * h + i), xi = elem::load(px, r * h + i);
      elem::store(ptr<u16>(got), r * h + i, elem::rmsnorm_dx(d, xi, pg[i], inv, mean));
      elem::store(ptr<u16>(wrong), r * h + i, inv * r16(d * pg[i] - xi * inv * mean));
    }
  }
  EXPECT_EQ(first_difference(got, dx), "") << "dx";
  EXPECT_NE(first_difference(wrong, dx), "") << "dx with the bracket rounded";
}

TEST(CudaTwins, RopeMatchesTheCpuBoundary) {
  const I s = 8, b = 2, heads = 4, d = 16, half = d / 2;
  const double theta = 10000.0;
  for (const bool backward : {false, true}) {
    SCOPED_TRACE(backward ? "backward" : "forward");
    const std::vector<u16> bits = bf16_values(s * b * heads * d, backward ? 13 : 12);
    const Tensor want = bf16_tensor(bits, {s, b, heads * d});
    const Tensor got = bf16_tensor(bits, {s, b, heads * d});
    const Tensor wrong = bf16_tensor(bits, {s, b, heads * d});
    const I first = 3;
    if (backward)
      ops::rope_backward(want, heads, theta, first);
    else
      ops::rope_forward(want, heads, theta, first);
    const RopeTable t = rope_table(first + s, d, theta);
    const float sign = backward ? -1.0f : 1.0f;
    for (I p = 0; p < s; ++p)
      for (I row = 0; row < b * heads; ++row)
        for (I i = 0; i < half; ++i) {
          const auto at = std::size_t((first + p) * half + i);
          const I base = (p * b * heads + row) * d;
          const float c = t.cos[at], sn = sign * t.sin[at];
          float x1 = elem::load(ptr<u16>(got), base + i),
                x2 = elem::load(ptr<u16>(got), base + i + half);
          elem::rope_pair(x1, x2, c, sn);
          elem::store(ptr<u16>(got), base + i, x1);
          elem::store(ptr<u16>(got), base + i + half, x2);
          // Wrong: each product rounded to bf16 before the sum.
          const float w1 = elem::load(ptr<u16>(wrong), base + i),
                      w2 = elem::load(ptr<u16>(wrong), base + i + half);
          elem::store(ptr<u16>(wrong), base + i, r16(w1 * c) - r16(w2 * sn));
          elem::store(ptr<u16>(wrong), base + i + half, r16(w2 * c) + r16(w1 * sn));
        }
    EXPECT_EQ(first_difference(got, want), "");
    EXPECT_NE(first_difference(wrong, want), "");
  }
}

/// A copy of t (same dtype, same values).
Tensor clone(const Tensor& t) {
  Tensor c = like(t);
  std::copy_n(static_cast<const char*>(t.raw()), t.nbytes(), static_cast<char*>(c.raw()));
  return c;
}

TEST(CudaTwins, OptimizerUpdatesMatchTheCpuAndWriteTheCopyInTheSamePass) {
  // The cuda kernels' Sgd and AdamW functors, scalar and vector paths, against the cpu backend's
  // sgd_update and adamw_update over three steps: master weights and moments bit for bit, and
  // the bf16 compute copy written in the same pass equal to the cpu's copy of the same w (and to
  // bf16 of the master). Negative check: a vector path that updates elements i .. i + 3 of group
  // i (not 4i .. 4i + 3) differs.
  const I n = kN;
  for (const bool vec : {false, true}) {
    Tensor w = f32_tensor(n, 61), m = Tensor::empty({n}), v = Tensor::empty({n});
    ops::fill(m, 0.0f);
    ops::fill(v, 0.0f);
    Tensor tw = clone(w), tm = clone(m), tv = clone(v), sw = clone(w), tsw = clone(w);
    Tensor copy = Tensor::empty({n}, DType::bf16), tcopy = like(copy);
    Tensor scopy = like(copy), tscopy = like(copy);
    for (int t = 1; t <= 3; ++t) {
      Tensor g = f32_tensor(n, std::uint32_t(70 + t));
      for (float& x : g.f32()) x *= 1e-2f;
      const ops::AdamWStep s = test::adamw_step(1e-3, 0.9, 0.95, 1e-8, 0.1, t);
      ops::adamw_update(w, g, m, v, s, copy);
      run(elem::AdamW{ptr<float>(tw), ptr<float>(g), ptr<float>(tm), ptr<float>(tv), s.beta1,
                      s.beta2, s.eps, s.decay, s.step_size, s.sqrt_bias2, ptr<u16>(tcopy)},
          n, vec);
      ops::sgd_update(sw, g, 0.3f, scopy);
      run(elem::Sgd{ptr<float>(tsw), ptr<float>(g), 0.3f, ptr<u16>(tscopy)}, n, vec);
    }
    const std::string path = vec ? "vector path" : "scalar path";
    EXPECT_EQ(first_difference(tw, w), "") << "AdamW w, " << path;
    EXPECT_EQ(first_difference(tm, m), "") << "AdamW m, " << path;
    EXPECT_EQ(first_difference(tv, v), "") << "AdamW v, " << path;
    EXPECT_EQ(first_difference(tcopy, copy), "") << "AdamW copy, " << path;
    EXPECT_EQ(first_difference(tsw, sw), "") << "SGD w, " << path;
    EXPECT_EQ(first_difference(tscopy, scopy), "") << "SGD copy, " << path;
    for (I i = 0; i < n; ++i)
      ASSERT_EQ(ptr<u16>(copy)[i], bf16_bits(ptr<float>(w)[i])) << "the copy is bf16(w), at " << i;
  }
  // The vector path written wrong (group i's four elements taken as i .. i + 3).
  struct WrongGroups {
    elem::AdamW op;
    void one(I i) const { op.one(i); }
    void four(I i) const {
      for (I k = 0; k < 4; ++k) op.one(i + k);
    }
  };
  Tensor w = f32_tensor(n, 61), m = Tensor::empty({n}), v = Tensor::empty({n});
  ops::fill(m, 0.0f);
  ops::fill(v, 0.0f);
  Tensor tw = clone(w), tm = clone(m), tv = clone(v);
  const Tensor g = f32_tensor(n, 71);
  const ops::AdamWStep s{0.9f, 0.95f, 1e-8f, 1.0f, 1e-3f, float(std::sqrt(1.0 - 0.95))};
  ops::adamw_update(w, g, m, v, s);
  run(WrongGroups{elem::AdamW{ptr<float>(tw), ptr<float>(g), ptr<float>(tm), ptr<float>(tv),
                              s.beta1, s.beta2, s.eps, s.decay, s.step_size, s.sqrt_bias2,
                              nullptr}},
      n, true);
  EXPECT_NE(first_difference(tw, w), "");
}

}  // namespace
}  // namespace tpx
