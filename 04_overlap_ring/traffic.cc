#include "04_overlap_ring/traffic.h"

#include <cstdint>

#include "03_sequence_parallel/traffic.h"

namespace tpx::ring {

Traffic traffic(const BlockConfig& c, int n, int act_bytes) {
  require_formula(n >= 1, "ranks must be >= 1");
  using U = std::uint64_t;
  const U N = U(n), P = stream_bytes(c, act_bytes);
  const U chunks = (N - 1) * (P / N);  // one primitive's transfers
  Traffic layer{10 * chunks, 10 * chunks, 10 * (N - 1)};
  layer += sp::gain_all_reduces(c, n);
  const Traffic fwd{4 * chunks, 4 * chunks, 4 * (N - 1)};
  Traffic step = per_step(c, layer, fwd);
  step += lm_traffic(c, n, act_bytes, TpLayout::ring);  // the language model's ends
  return step;
}

}  // namespace tpx::ring
