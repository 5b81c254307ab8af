#include "02_megatron_tp/traffic.h"

#include <cstdint>

namespace tpx::megatron {

Traffic traffic(const BlockConfig& c, int n, int act_bytes) {
  require_formula(n >= 1, "ranks must be >= 1");
  using U = std::uint64_t;
  const U N = U(n), P = stream_bytes(c, act_bytes);
  const U all_reduce_bus = (P * 2 * (N - 1)) / N;
  const Traffic layer{4 * P, 4 * all_reduce_bus, 4};
  const Traffic fwd{2 * P, 2 * all_reduce_bus, 2};
  Traffic step = per_step(c, layer, fwd);
  step += lm_traffic(c, n, act_bytes, TpLayout::all_reduce);  // the language model's ends
  return step;
}

}  // namespace tpx::megatron
