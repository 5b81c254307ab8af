#include "02_megatron_tp/traffic.h"

#include <cstdint>

namespace tpx::megatron {

Traffic traffic(const BlockConfig& c, int n, int act_bytes) {
  require_formula(n >= 1, "ranks must be >= 1");
  using U = std::uint64_t;
  const U N = U(n), e = U(act_bytes == 0 ? activation_bytes(c) : act_bytes);
  const U P = U(c.seq * c.batch * c.hidden) * e;
  const U all_reduce_bus = (P * 2 * (N - 1)) / N;
  const Traffic layer{4 * P, 4 * all_reduce_bus, 4};
  const Traffic fwd{2 * P, 2 * all_reduce_bus, 2};
  return per_step(c, layer, fwd);
}

}  // namespace tpx::megatron
