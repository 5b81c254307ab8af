// The low-precision recipes' quantizers (common/lowp.h) on the cpu: block by block, every scale
// and every cast through the bit-exact functions of common/fp8_bits.h and common/lowp_bits.h.
#include "lowp.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <string>

#include <fmt/format.h>

#include "check.h"
#include "checked.h"

namespace tpx::lowp {
namespace {

struct Name {
  Recipe recipe;
  std::string_view name;
};
constexpr std::array<Name, 5> kNames{{{Recipe::tensorwise, "tensorwise"},
                                      {Recipe::rowwise, "rowwise"},
                                      {Recipe::block128, "block128"},
                                      {Recipe::mxfp8, "mxfp8"},
                                      {Recipe::nvfp4, "nvfp4"}}};

}  // namespace

std::string_view to_string(Recipe recipe) {
  for (const Name& n : kNames)
    if (n.recipe == recipe) return n.name;
  fail("unknown low-precision recipe");
}

std::optional<Recipe> parse_recipe(std::string_view name) {
  for (const Name& n : kNames)
    if (n.name == name) return n.recipe;
  return std::nullopt;
}

Layout layout(Recipe recipe, Operand operand) {
  const fp8::Format fp8_element = operand == Operand::gradient ? fp8::kE5M2 : fp8::kE4M3;
  switch (recipe) {
    case Recipe::tensorwise:
      return {fp8_element, 0, 0, ScaleFormat::fp32};
    case Recipe::rowwise:
      return {fp8_element, 1, 0, ScaleFormat::fp32};
    case Recipe::block128:
      return {fp8::kE4M3, operand == Operand::weight ? 128 : 1, 128, ScaleFormat::fp32};
    case Recipe::mxfp8:
      return {fp8_element, 1, 32, ScaleFormat::e8m0};
    case Recipe::nvfp4:
      return {kE2M1, 1, 16, ScaleFormat::ue4m3};
  }
  fail("unknown low-precision recipe");
}

float block_amax(const float* x, std::int64_t cols, std::int64_t r0, std::int64_t r1,
                 std::int64_t c0, std::int64_t c1) {
  float m = 0.0f;
  for (std::int64_t r = r0; r < r1; ++r) {
    for (std::int64_t c = c0; c < c1; ++c) {
      const float v = x[r * cols + c];
      if (fp8::is_nan(v)) return fp8::bits_float(fp8::kNaNBits);
      m = std::fmax(m, std::fabs(v));
    }
  }
  return m;
}

Quantized quantize(const float* x, std::int64_t rows, std::int64_t cols, Recipe recipe,
                   Operand operand, std::optional<float> tensor_amax,
                   const StochasticRounding* stochastic) {
  if (rows <= 0 || cols <= 0)
    fail(fmt::format("quantizing a {} x {} matrix: both sizes must be positive", rows, cols));
  if (stochastic != nullptr && recipe != Recipe::nvfp4)
    fail(
        fmt::format("stochastic rounding under --fp8-recipe {}: only nvfp4's E2M1 casts round "
                    "stochastically",
                    to_string(recipe)));
  Quantized q{recipe, layout(recipe, operand), rows, cols, 0, 0, {}, {}, {}, 1.0f};
  const Layout& l = q.layout;
  const std::int64_t br = l.block_rows == 0 ? rows : l.block_rows;
  const std::int64_t bc = l.block_cols == 0 ? cols : l.block_cols;
  q.scale_rows = (rows + br - 1) / br;
  q.scale_cols = (cols + bc - 1) / bc;
  const std::int64_t n = checked_product({rows, cols}, "the operand's element count");
  q.codes.resize(static_cast<std::size_t>(n));
  const auto n_scales = static_cast<std::size_t>(q.scale_rows * q.scale_cols);
  if (l.scale == ScaleFormat::fp32) {
    q.scales.resize(n_scales);
  } else {
    q.scale_codes.resize(n_scales);
  }
  if (recipe == Recipe::nvfp4)
    q.tensor_scale =
        nvfp4_tensor_scale(tensor_amax ? *tensor_amax : block_amax(x, cols, 0, rows, 0, cols));

  for (std::int64_t sr = 0; sr < q.scale_rows; ++sr) {
    for (std::int64_t sc = 0; sc < q.scale_cols; ++sc) {
      const std::int64_t r0 = sr * br, r1 = std::min(rows, r0 + br);
      const std::int64_t c0 = sc * bc, c1 = std::min(cols, c0 + bc);
      const auto s = static_cast<std::size_t>(sr * q.scale_cols + sc);
      const BlockScale b = block_scale(block_amax(x, cols, r0, r1, c0, c1), l, q.tensor_scale);
      if (l.scale == ScaleFormat::fp32) {
        q.scales[s] = b.scale;
      } else {
        q.scale_codes[s] = b.code;
      }
      for (std::int64_t r = r0; r < r1; ++r)
        for (std::int64_t c = c0; c < c1; ++c) {
          const std::uint32_t bits = stochastic ? sr_bits(*stochastic, r, c) : 0u;
          q.codes[static_cast<std::size_t>(r * cols + c)] =
              cast_element(x[r * cols + c], l, b, q.tensor_scale, stochastic != nullptr, bits);
        }
    }
  }
  return q;
}

std::vector<float> dequantize(const Quantized& q) {
  const Layout& l = q.layout;
  const std::int64_t br = l.block_rows == 0 ? q.rows : l.block_rows;
  const std::int64_t bc = l.block_cols == 0 ? q.cols : l.block_cols;
  std::vector<float> out(q.codes.size());
  for (std::int64_t r = 0; r < q.rows; ++r) {
    for (std::int64_t c = 0; c < q.cols; ++c) {
      const auto i = static_cast<std::size_t>(r * q.cols + c);
      const auto s = static_cast<std::size_t>((r / br) * q.scale_cols + c / bc);
      const BlockScale b = l.scale == ScaleFormat::fp32 ? BlockScale{q.scales[s], 0}
                                                        : BlockScale{1.0f, q.scale_codes[s]};
      out[i] = decode_element(q.codes[i], l, b, q.tensor_scale);
    }
  }
  return out;
}

std::int64_t storage_bytes(std::int64_t rows, std::int64_t cols, Recipe recipe, Operand operand) {
  if (rows <= 0 || cols <= 0)
    fail(fmt::format("the bytes of a {} x {} matrix: both sizes must be positive", rows, cols));
  const Layout l = layout(recipe, operand);
  const std::int64_t br = l.block_rows == 0 ? rows : l.block_rows;
  const std::int64_t bc = l.block_cols == 0 ? cols : l.block_cols;
  const std::int64_t n = checked_product({rows, cols}, "the operand's element count");
  const std::int64_t codes = recipe == Recipe::nvfp4 ? n / 2 + n % 2 : n;
  const std::int64_t scales = ((rows + br - 1) / br) * ((cols + bc - 1) / bc);
  const std::int64_t scale_bytes = l.scale == ScaleFormat::fp32 ? 4 : 1;
  return codes + scales * scale_bytes + (recipe == Recipe::nvfp4 ? 4 : 0);
}

template <class T>
void hadamard_rows(std::vector<T>& m, std::int64_t rows, std::int64_t cols) {
  using I = std::int64_t;
  TPX_CHECK(I(m.size()) == rows * cols, "hadamard_rows: {} elements for a {} x {} matrix", m.size(),
            rows, cols);
  // R[i][j] = H₁₆[i][j]·s[j] / 4, with H₁₆[i][j] = (−1)^popcount(i & j) (Sylvester's order);
  // rht_entry (common/lowp_block.h, which the CUDA kernel calls) is the same, checked here.
  std::array<std::array<T, kRhtSize>, kRhtSize> r{};
  for (int i = 0; i < kRhtSize; ++i)
    for (int j = 0; j < kRhtSize; ++j) {
      r[std::size_t(i)][std::size_t(j)] =
          T((std::popcount(unsigned(i & j)) % 2 == 0 ? 1 : -1) * kRhtSigns[std::size_t(j)]) / T(4);
      TPX_CHECK(r[std::size_t(i)][std::size_t(j)] == T(rht_entry(i, j)),
                "rht_entry({}, {}) is not R's entry", i, j);
    }
  std::vector<T> group(static_cast<std::size_t>(kRhtSize * cols));
  for (I g = 0; g + kRhtSize <= rows; g += kRhtSize) {
    T* block = m.data() + g * cols;
    std::copy(block, block + kRhtSize * cols, group.begin());
    for (int i = 0; i < kRhtSize; ++i)
      for (I c = 0; c < cols; ++c) {
        T sum = 0;
        for (int j = 0; j < kRhtSize; ++j)
          sum += r[std::size_t(i)][std::size_t(j)] * group[std::size_t(j * cols + c)];
        block[i * cols + c] = sum;
      }
  }
}
template void hadamard_rows(std::vector<float>&, std::int64_t, std::int64_t);
template void hadamard_rows(std::vector<double>&, std::int64_t, std::int64_t);

std::vector<double> emulate(const std::vector<double>& m, std::int64_t rows, std::int64_t cols,
                            bool k_rows, Recipe recipe, Operand operand, std::int64_t parts,
                            const StochasticRounding* stochastic) {
  using I = std::int64_t;
  const I outer = k_rows ? cols : rows, k = k_rows ? rows : cols, part = k / parts;
  // m's element (outer index r, reduction index j).
  auto at = [&](I r, I j) {
    return static_cast<std::size_t>(k_rows ? j * cols + r : r * cols + j);
  };
  std::vector<double> out(m.size());
  std::vector<float> x(static_cast<std::size_t>(outer * part));
  // nvfp4's tensor scale: the whole m's amax, which a rank's shard of K is given.
  std::optional<float> whole;
  if (recipe == Recipe::nvfp4 && parts > 1) {
    const std::vector<float> all(m.begin(), m.end());
    whole = block_amax(all.data(), 1, 0, I(all.size()), 0, 1);
  }
  for (I p = 0; p < parts; ++p) {
    for (I r = 0; r < outer; ++r)
      for (I j = 0; j < part; ++j)
        x[static_cast<std::size_t>(r * part + j)] = static_cast<float>(m[at(r, p * part + j)]);
    // The part's place in m (rows: tokens, columns: features) for stochastic rounding: K is
    // the features (k_rows false) or the tokens (k_rows true, the quantizer's matrix then m
    // transposed).
    std::optional<StochasticRounding> sr;
    if (stochastic) {
      sr = *stochastic;
      sr->k_rows = k_rows;
      (k_rows ? sr->token0 : sr->feature0) += p * part;
    }
    const std::vector<float> d =
        dequantize(quantize(x.data(), outer, part, recipe, operand, whole, sr ? &*sr : nullptr));
    for (I r = 0; r < outer; ++r)
      for (I j = 0; j < part; ++j)
        out[at(r, p * part + j)] = double(d[static_cast<std::size_t>(r * part + j)]);
  }
  return out;
}

}  // namespace tpx::lowp
