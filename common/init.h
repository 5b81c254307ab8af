// Counter-based, shard-independent initialisation.
//
// Every value is a pure function of (seed, tensor id, element index): SplitMix64 mixes the three
// into 64 random bits, which become two uniforms and, through Box-Muller, one standard normal. So a
// rank can generate exactly its shard, and that shard equals the slice of the full tensor.
//
// defines: tpx::TensorId, tpx::bits_at(), tpx::normal_at(), tpx::Window, tpx::fill_normal()
#pragma once

#include <cstdint>

#include "tensor.h"

namespace tpx {

/// Tensor ids: the input and target, the language model's own tensors and draws, then 16 ids per
/// layer (9 used: see Param in model.h).
struct TensorId {
  static constexpr std::uint64_t input = 1;
  static constexpr std::uint64_t target = 2;
  static constexpr std::uint64_t embedding = 3;  ///< E [V, H]
  static constexpr std::uint64_t norm_f = 4;     ///< (a gain: 1, drawn from nothing)
  static constexpr std::uint64_t w_out = 5;      ///< W_out [H, V]
  static constexpr std::uint64_t tokens = 6;     ///< --data synthetic's ids
  static constexpr std::uint64_t windows = 7;    ///< where each sequence of a step starts
  static constexpr std::uint64_t sample = 8;     ///< --generate's draws, one per new token
  static constexpr std::uint64_t layer(std::int64_t l, int param) {
    return 16 + 16 * static_cast<std::uint64_t>(l) + static_cast<std::uint64_t>(param);
  }
};

/// 64 random bits for element `index` of tensor `id` under `seed` (SplitMix64 of the three).
std::uint64_t bits_at(std::uint64_t seed, std::uint64_t id, std::uint64_t index);

/// The standard normal value of element `index` of tensor `id` under `seed`.
double normal_at(std::uint64_t seed, std::uint64_t id, std::uint64_t index);

/// Where a local tensor [rows, cols] sits inside the full matrix [full_rows, full_cols]
/// (tensors are seen as matrices: all dims but the last are rows).
struct Window {
  std::int64_t full_cols = 0;
  std::int64_t row0 = 0;
  std::int64_t col0 = 0;
};

/// Fills a cpu f32 tensor with mean + std * normal_at(seed, id, full index) over its window.
void fill_normal(Tensor& t, std::uint64_t seed, std::uint64_t id, const Window& w, double mean,
                 double std);

}  // namespace tpx
