#include "06_fp8/traffic.h"

#include <cstdint>

#include "03_sequence_parallel/traffic.h"

namespace tpx::async_fp8 {

Traffic traffic(const BlockConfig& c, int n, int act_bytes) {
  require_formula(n >= 1, "ranks must be >= 1");
  using U = std::uint64_t;
  const U N = U(n), e = U(act_bytes == 0 ? 2 : act_bytes);
  const U chunk = U(c.seq * c.batch * c.hidden) / N;  // elements of one [S/N, B, H] shard
  const U moved = 6 * (N - 1) * chunk * 1 + 4 * (N - 1) * chunk * e;
  const U moved_fwd = 2 * (N - 1) * chunk * 1 + 2 * (N - 1) * chunk * e;
  Traffic amax, amax_fwd;  // the eight MAX all-reduces, and the forward's four
  int i = 0;
  for (const U k : {4, 2, 3, 2, 3, 2, 2, 2}) {
    const Traffic one{4 * k, (4 * k * 2 * (N - 1)) / N, 1};
    amax += one;
    if (i++ < 4) amax_fwd += one;
  }
  Traffic layer{moved, moved, 10 * (N - 1)};
  layer += sp::gain_all_reduces(c, n);
  layer += amax;
  Traffic fwd{moved_fwd, moved_fwd, 4 * (N - 1)};
  fwd += amax_fwd;
  Traffic step = per_step(c, layer, fwd);
  step += lm_traffic(c, n, act_bytes, TpLayout::ring);  // the language model's ends
  return step;
}

}  // namespace tpx::async_fp8
