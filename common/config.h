// The block's hyper-parameters and the run's settings, with validation.
//
// defines: tpx::Attention, tpx::BlockConfig, tpx::validate(), tpx::dtype_flag(),
//          tpx::attention_flag(), tpx::high_precision()
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tensor.h"

namespace tpx {

/// RMSNorm epsilon, fixed by the design (DESIGN.md, "The block").
inline constexpr double kNormEps = 1e-5;

/// How the block computes attention (--attention). fused: blockwise with an online softmax
/// (FlashAttention-2), keeping only the per-row log-sum-exp [B, NH, S] for backward; naive:
/// the readable version, materialising and keeping the probabilities [B, NH, S, S].
enum class Attention { fused, naive };

/// Everything that defines a run of a stage. Defaults are the tutorial's default config.
struct BlockConfig {
  std::int64_t hidden = 256;  ///< H
  std::int64_t heads = 8;     ///< NH; head dim D = H / NH
  std::int64_t ffn = 1024;    ///< F, the SwiGLU inner size
  std::int64_t seq = 128;     ///< S
  std::int64_t batch = 2;     ///< B
  std::int64_t layers = 2;    ///< L stacked blocks
  std::int64_t steps = 5;     ///< SGD steps (--steps)
  double lr = 1.0;            ///< SGD learning rate (the loss is a mean, so grads are small)
  std::uint64_t seed = 1234;
  Device device = Device::cpu;
  /// The linear layers' GEMM operands: f32, bf16, or e4m3 for stage 06's FP8 recipe (--dtype fp8:
  /// E4M3 activations and weights, E5M2 gradients).
  DType dtype = DType::f32;
  Attention attention = Attention::fused;

  std::int64_t head_dim() const { return hidden / heads; }
  std::int64_t tokens() const { return seq * batch; }
};

/// The --dtype word for a config's dtype: "fp32", "bf16" or "fp8".
std::string_view dtype_flag(DType d);
/// The --attention word: "fused" or "naive".
constexpr std::string_view attention_flag(Attention a) {
  return a == Attention::fused ? "fused" : "naive";
}
/// The operand type of the GEMMs that never run in FP8 (attention's): d, or fp32 under fp8.
constexpr DType high_precision(DType d) {
  return is_fp8(d) ? DType::f32 : d;
}

/// Every problem with the config, one clear sentence each; empty when it is valid.
std::vector<std::string> validate(const BlockConfig& c);

}  // namespace tpx
