#include "rope.h"

#include <cmath>

#include "check.h"

namespace tpx {

RopeTable rope_table(std::int64_t seq, std::int64_t head_dim, double theta) {
  TPX_CHECK(seq > 0 && head_dim > 0 && head_dim % 2 == 0 && theta > 0,
            "rope table: seq {} and head dim {} (even) and theta {} must be positive", seq,
            head_dim, theta);
  RopeTable t{seq, head_dim / 2, theta, {}, {}};
  const auto n = static_cast<std::size_t>(seq * t.half);
  t.cos.resize(n);
  t.sin.resize(n);
  for (std::int64_t i = 0; i < t.half; ++i) {
    // θ^(−2i/D): Llama's inv_freq, the frequency of pair i.
    const double freq = std::pow(theta, -2.0 * double(i) / double(head_dim));
    for (std::int64_t p = 0; p < seq; ++p) {
      const double angle = double(p) * freq;
      const auto k = static_cast<std::size_t>(p * t.half + i);
      t.cos[k] = static_cast<float>(std::cos(angle));
      t.sin[k] = static_cast<float>(std::sin(angle));
    }
  }
  return t;
}

}  // namespace tpx
