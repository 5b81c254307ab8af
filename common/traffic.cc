#include "traffic.h"

#include <stdexcept>

namespace tpx {

void require_formula(bool ok, const char* why) {
  if (!ok) throw std::runtime_error(why);
}

Traffic per_step(const BlockConfig& c, const Traffic& layer, const Traffic& fwd) {
  const auto L = static_cast<std::uint64_t>(c.layers);
  const auto R = static_cast<std::uint64_t>(c.recomputed_layers());
  return {layer.payload * L + fwd.payload * R, layer.bus * L + fwd.bus * R,
          layer.calls * L + fwd.calls * R};
}

int activation_bytes(const BlockConfig& c) {
  return c.activations() == DType::bf16 ? 2 : 4;
}

std::uint64_t stream_bytes(const BlockConfig& c, int act_bytes) {
  const int e = act_bytes == 0 ? activation_bytes(c) : act_bytes;
  return static_cast<std::uint64_t>(c.seq * c.batch * c.hidden) * static_cast<std::uint64_t>(e);
}

double layer_params_per_tp_rank(const BlockConfig& c, int tp) {
  require_formula(tp >= 1, "TP ranks must be >= 1");
  const double H = double(c.hidden), KV = double(c.kv_dim()), F = double(c.ffn);
  return (H * (H + 2 * KV) + H * H + 3 * H * F) / tp + 2 * H;
}

}  // namespace tpx
