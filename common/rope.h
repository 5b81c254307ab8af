// The rotary embedding's angles, shared by both backends so that their cos and sin are the same
// fp32 numbers: computed in double, rounded once.
//
// defines: tpx::RopeTable, tpx::rope_table()
#pragma once

#include <cstdint>
#include <vector>

namespace tpx {

/// cos and sin of p·θ^(−2i/D) for positions p < seq and pairs i < D/2, row-major [seq, D/2].
struct RopeTable {
  std::int64_t seq = 0, half = 0;  ///< rows, and D/2 columns
  double theta = 0;
  std::vector<float> cos, sin;
};

/// The table for `seq` positions of a head of `head_dim` (even) elements.
RopeTable rope_table(std::int64_t seq, std::int64_t head_dim, double theta);

}  // namespace tpx
