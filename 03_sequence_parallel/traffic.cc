#include "03_sequence_parallel/traffic.h"

#include <cstdint>

namespace tpx::sp {

Traffic gain_all_reduces(const BlockConfig& c, int n) {
  using U = std::uint64_t;
  const U N = U(n), H = U(c.hidden);
  return {8 * H, 2 * ((4 * H * 2 * (N - 1)) / N), 2};
}

Traffic traffic(const BlockConfig& c, int n, int act_bytes) {
  require_formula(n >= 1, "ranks must be >= 1");
  using U = std::uint64_t;
  const U N = U(n), P = stream_bytes(c, act_bytes);
  Traffic layer{10 * P, 10 * (P * (N - 1) / N), 10};
  layer += gain_all_reduces(c, n);
  const Traffic fwd{4 * P, 4 * (P * (N - 1) / N), 4};
  Traffic step = per_step(c, layer, fwd);
  step += lm_traffic(c, n, act_bytes, TpLayout::sequence);  // the language model's ends
  return step;
}

}  // namespace tpx::sp
