// lowp_layouts: what each low-precision recipe of common/lowp.h does to one operand matrix, as
// JSON, for tools/recipe_svg.py's figure (chapter 6, "The formats").
//
//   lowp_layouts [--rows R] [--cols K]
//
// Quantizes one deterministic R × K matrix (default 8 × 256, K along the GEMM's reduction; O(1)
// values and one outlier of 40 at row R/2 + 1, column 3K/5) with lowp::quantize under every recipe
// (block128 twice: as an activation and as a weight) and prints, per panel, the element and scale
// formats, the block, the grid of scales and each block's dequantization factor (the value one
// code step of 1 stands for: 1 / scale, the E8M0 power of two, or decode(d_b) / s_enc), and the
// bytes: codes, scales, and lowp::storage_bytes. The bytes of the codes and the scales are counted
// from what lowp::quantize returned; their sum must equal lowp::storage_bytes, which counts them
// from the layout alone, or the tool says so and exits 1. Bad arguments: one line, exit 2.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "common/fp8_bits.h"
#include "common/lowp.h"
#include "common/lowp_bits.h"

namespace {

using tpx::lowp::Operand;
using tpx::lowp::Recipe;
using tpx::lowp::ScaleFormat;

constexpr std::int64_t kMaxElements = std::int64_t{1} << 22;

/// The element format's name, E<e>M<m>, from its mantissa width and bias (bias = 2^(e−1) − 1).
std::string element_name(const tpx::fp8::Format& f) {
  int e = 1;
  while ((1 << (e - 1)) - 1 < f.bias) ++e;
  return fmt::format("E{}M{}", e, f.mantissa_bits);
}

int element_bits(const tpx::fp8::Format& f) {
  int e = 1;
  while ((1 << (e - 1)) - 1 < f.bias) ++e;
  return 1 + e + f.mantissa_bits;
}

const char* scale_name(ScaleFormat s) {
  switch (s) {
    case ScaleFormat::fp32:
      return "fp32";
    case ScaleFormat::e8m0:
      return "E8M0";
    case ScaleFormat::ue4m3:
      return "UE4M3";
  }
  return "?";
}

/// The value a code step of 1 stands for in block s: what dequantize multiplies a decoded element by.
double factor(const tpx::lowp::Quantized& q, std::size_t s) {
  switch (q.layout.scale) {
    case ScaleFormat::fp32:
      return 1.0 / double(q.scales[s]);
    case ScaleFormat::e8m0:
      return double(tpx::lowp::e8m0_decode(q.scale_codes[s]));
    case ScaleFormat::ue4m3:
      return double(tpx::lowp::ue4m3_decode(q.scale_codes[s])) / double(q.tensor_scale);
  }
  return 0.0;
}

nlohmann::json panel(const std::vector<float>& x, std::int64_t rows, std::int64_t cols,
                     Recipe recipe, Operand operand) {
  const tpx::lowp::Quantized q = tpx::lowp::quantize(x.data(), rows, cols, recipe, operand);
  const tpx::lowp::Layout& l = q.layout;
  const tpx::lowp::Layout grad = tpx::lowp::layout(recipe, Operand::gradient);
  const std::int64_t n = rows * cols;
  const std::int64_t code_bytes = (n * element_bits(l.element) + 7) / 8;
  const std::int64_t scale_bytes = std::int64_t(q.scales.size()) * 4 +
                                   std::int64_t(q.scale_codes.size()) +
                                   (recipe == Recipe::nvfp4 ? 4 : 0);  // s_enc, fp32
  const std::int64_t storage = tpx::lowp::storage_bytes(rows, cols, recipe, operand);
  if (code_bytes + scale_bytes != storage)
    throw std::runtime_error(fmt::format(
        "{} ({}): codes {} + scales {} bytes counted from lowp::quantize, but "
        "lowp::storage_bytes says {}",
        tpx::lowp::to_string(recipe), operand == Operand::weight ? "weight" : "activation",
        code_bytes, scale_bytes, storage));
  // The same operand grown to whole blocks (a weight's 128 rows): the scales' bytes per element
  // when no block is partial.
  const std::int64_t whole_rows =
      l.block_rows == 0 ? rows : (rows + l.block_rows - 1) / l.block_rows * l.block_rows;
  const std::int64_t whole_cols =
      l.block_cols == 0 ? cols : (cols + l.block_cols - 1) / l.block_cols * l.block_cols;
  const std::int64_t whole_n = whole_rows * whole_cols;
  const std::int64_t whole_scale_bytes =
      tpx::lowp::storage_bytes(whole_rows, whole_cols, recipe, operand) -
      (whole_n * element_bits(l.element) + 7) / 8;
  nlohmann::json factors = nlohmann::json::array();
  for (std::size_t s = 0; s < std::size_t(q.scale_rows * q.scale_cols); ++s)
    factors.push_back(factor(q, s));
  return {{"recipe", std::string(tpx::lowp::to_string(recipe))},
          {"operand", operand == Operand::weight ? "weight" : "activation"},
          {"element", element_name(l.element)},
          {"gradient_element", element_name(grad.element)},
          {"element_bits", element_bits(l.element)},
          {"scale", scale_name(l.scale)},
          {"block_rows", l.block_rows},
          {"block_cols", l.block_cols},
          {"scale_rows", q.scale_rows},
          {"scale_cols", q.scale_cols},
          {"factors", factors},
          {"tensor_scale", recipe == Recipe::nvfp4 ? nlohmann::json(double(q.tensor_scale))
                                                   : nlohmann::json(nullptr)},
          {"code_bytes", code_bytes},
          {"scale_bytes", scale_bytes},
          {"storage_bytes", storage},
          {"whole_blocks",
           {{"rows", whole_rows}, {"cols", whole_cols}, {"scale_bytes", whole_scale_bytes}}}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"lowp_layouts: each recipe of common/lowp.h over one matrix, as JSON"};
  std::int64_t rows = 8, cols = 256;
  app.add_option("--rows", rows, "the matrix's rows (its outer dimension)");
  app.add_option("--cols", cols, "the matrix's columns (K, the reduction)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (rows <= 0 || cols <= 0 || rows > kMaxElements / cols) {
    std::fprintf(stderr,
                 "lowp_layouts: --rows %lld --cols %lld: both must be positive, the product at "
                 "most %lld\n",
                 static_cast<long long>(rows), static_cast<long long>(cols),
                 static_cast<long long>(kMaxElements));
    return 2;
  }
  try {
    // O(1) values that vary along both dimensions, and one outlier.
    std::vector<float> x(std::size_t(rows * cols));
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c)
        x[std::size_t(r * cols + c)] =
            float((0.5 + 0.4 * std::sin(0.37 * double(r) + 0.05 * double(c))) *
                  std::cos(0.9 * double(c) + 0.3 * double(r)));
    const std::int64_t outlier_row = std::min(rows - 1, rows / 2 + 1), outlier_col = 3 * cols / 5;
    x[std::size_t(outlier_row * cols + outlier_col)] = 40.0f;

    nlohmann::json panels = nlohmann::json::array();
    panels.push_back(panel(x, rows, cols, Recipe::tensorwise, Operand::activation));
    panels.push_back(panel(x, rows, cols, Recipe::rowwise, Operand::activation));
    panels.push_back(panel(x, rows, cols, Recipe::block128, Operand::activation));
    panels.push_back(panel(x, rows, cols, Recipe::block128, Operand::weight));
    panels.push_back(panel(x, rows, cols, Recipe::mxfp8, Operand::activation));
    panels.push_back(panel(x, rows, cols, Recipe::nvfp4, Operand::activation));
    const nlohmann::json out{
        {"rows", rows},
        {"cols", cols},
        {"outlier", {{"row", outlier_row}, {"col", outlier_col}, {"value", 40.0}}},
        {"panels", panels}};
    std::printf("%s\n", out.dump(1).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lowp_layouts: %s\n", e.what());
    return 1;
  }
  return 0;
}
