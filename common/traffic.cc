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

namespace {

using U = std::uint64_t;

/// One collective of `payload` bytes as the communicator counts it.
Traffic all_reduce(U payload, U n) {
  return {payload, payload * 2 * (n - 1) / n, 1};
}
Traffic gather_or_scatter(U payload, U n) {
  return {payload, payload * (n - 1) / n, 1};
}
/// A ring all-gather or reduce-scatter of `payload` bytes: N − 1 steps of P/N each.
Traffic ring_steps(U payload, U n) {
  const U moved = (n - 1) * (payload / n);
  return {moved, moved, n - 1};
}

}  // namespace

Traffic lm_embedding_traffic(const BlockConfig& c, int n, int act_bytes, TpLayout layout) {
  require_formula(n >= 1, "ranks must be >= 1");
  if (!c.lm()) return {};
  const U N = U(n), P = stream_bytes(c, act_bytes);
  if (layout == TpLayout::all_reduce) return all_reduce(P, N);
  Traffic t = gather_or_scatter(P, N);  // forward: reduce-scatter
  t += gather_or_scatter(P, N);         // backward: all-gather
  return t;
}

Traffic lm_head_traffic(const BlockConfig& c, int n, int act_bytes, TpLayout layout) {
  require_formula(n >= 1, "ranks must be >= 1");
  if (!c.lm()) return {};
  const U N = U(n), P = stream_bytes(c, act_bytes), vector = 4 * U(c.seq * c.batch);
  Traffic t;
  switch (layout) {
    case TpLayout::all_reduce:
      t += all_reduce(P, N);  // f backward
      break;
    case TpLayout::sequence:
      for (int i = 0; i < 3; ++i) t += gather_or_scatter(P, N);
      break;
    case TpLayout::ring:
      for (int i = 0; i < 3; ++i) t += ring_steps(P, N);
      break;
  }
  for (int i = 0; i < 3; ++i) t += all_reduce(vector, N);  // the cross-entropy's MAX, SUM, SUM
  if (layout != TpLayout::all_reduce) t += all_reduce(4 * U(c.hidden), N);  // the final gain
  return t;
}

Traffic lm_traffic(const BlockConfig& c, int n, int act_bytes, TpLayout layout) {
  Traffic t = lm_embedding_traffic(c, n, act_bytes, layout);
  t += lm_head_traffic(c, n, act_bytes, layout);
  return t;
}

Traffic lm_grads_traffic(const BlockConfig& c, int tp, int group, bool embedding, bool head,
                         int microbatches) {
  require_formula(tp >= 1 && group >= 1 && microbatches >= 1,
                  "TP, DP×CP ranks and micro-batches must be >= 1");
  if (!c.lm() || group == 1) return {};
  const U T = U(tp), G = U(group), M = U(microbatches), H = U(c.hidden);
  const U local = (U(c.vocab) + T - 1) / T;  // V_pad / T: the rank's rows (or columns)
  const U w_out = U(activation_bytes(c));    // the output layer's compute copy
  // One unit: M all-gathers of one rank's part (`part` bytes; G parts gathered, G − 1 of them
  // on the bus) and one fp32 reduce-scatter of the padded flat gradient [G · numel].
  auto unit = [&](U part, U numel) {
    const U gathered = G * part, reduced = G * numel * 4;
    return Traffic{M * gathered + reduced,
                   M * gather_or_scatter(gathered, G).bus + gather_or_scatter(reduced, G).bus,
                   M + 1};
  };
  Traffic t;
  if (embedding) {
    const U rows = (local + G - 1) / G;  // of the [V_pad/T, H] table, fp32
    t += unit(rows * H * 4, rows * H);
  }
  if (head) {
    const U rows = (H + G - 1) / G;  // of the gain [H], fp32, then of W_out [H, V_pad/T]
    t += unit(rows * 4 + rows * local * w_out, rows * (1 + local));
  }
  return t;
}

double layer_params_per_tp_rank(const BlockConfig& c, int tp) {
  require_formula(tp >= 1, "TP ranks must be >= 1");
  const double H = double(c.hidden), KV = double(c.kv_dim()), F = double(c.ffn);
  return (H * (H + 2 * KV) + H * H + 3 * H * F) / tp + 2 * H;
}

}  // namespace tpx
