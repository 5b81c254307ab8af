#include "traffic.h"

#include <array>
#include <stdexcept>

#include <fmt/format.h>

namespace tpx {
namespace {

// Pure arithmetic shared with the projection library (no MPI): errors are std::runtime_error.
void check(bool ok, const char* why) {
  if (!ok) throw std::runtime_error(why);
}

/// A step of L layers from one layer's traffic `layer` and its forward's share `fwd`, which each
/// layer that --recompute full recomputes (--recompute-every) moves once more.
Traffic per_step(const BlockConfig& c, const Traffic& layer, const Traffic& fwd) {
  const auto L = static_cast<std::uint64_t>(c.layers);
  const auto R = static_cast<std::uint64_t>(c.recomputed_layers());
  return {layer.payload * L + fwd.payload * R, layer.bus * L + fwd.bus * R,
          layer.calls * L + fwd.calls * R};
}

}  // namespace

// Per rank and step, L layers, N ranks, E = act_bytes, P = S·B·H·E (one [S, B, H] activation):
//   01  nothing.
//   02  four all-reduces of P per layer (g after Wo, Wd; f before Wqkv, Wgu in backward):
//       payload 4P, bus 4·⌊P·2(N−1)/N⌋, calls 4.            (02_megatron_tp/README.md)
//   03  ten all-gathers / reduce-scatters of the full P per layer (forward 2 + 2, backward the
//       2 dY gathers, the 2 re-gathers of the kept inputs and 2 reduce-scatters), bus P·(N−1)/N
//       each, and two all-reduces of the norm gains' gradients [H] (fp32):
//       payload 10P + 8H, bus 10·P(N−1)/N + 2·⌊4H·2(N−1)/N⌋, calls 12. (03_sequence_parallel)
//   04  each of the ten primitives is N−1 ring transfers of one P/N chunk (a send counts what it
//       sends): payload = bus = 10(N−1)·P/N, plus the gains as in 03; calls 10(N−1) + 2.
//   05  04's, the transfers being copy-engine pulls (payload = bus = the bytes pulled).
//   06  05's, the six gathers per layer moving 1-byte FP8 codes (the four reduce-scatters stay
//       E), plus eight MAX all-reduces of k fp32 amaxes per layer, k ∈ {4,2,3,2,3,2,2,2}:
//       payload 4k, bus ⌊4k·2(N−1)/N⌋ each.                  (06_fp8/README.md)
// Under --recompute full each recomputed layer's forward (every --recompute-every K-th) runs
// again before its backward, collectives included: its share (02: the two g all-reduces; 03: two
// all-gathers and two reduce-scatters; 04, 05: those four as ring transfers; 06: two FP8 gathers,
// two reduce-scatters and the four forward amax all-reduces, k ∈ {4,2,3,2}) is counted twice. GQA
// changes none of it: the collectives move the [S, B, H] stream, whatever the width of k and v.
int activation_bytes(int stage, const BlockConfig& c) {
  return stage == 6 || c.activations() == DType::bf16 ? 2 : 4;
}

Traffic comm_bytes(int stage, const BlockConfig& c, int n, int act_bytes) {
  check(n >= 1, "ranks must be >= 1");
  if (act_bytes == 0) act_bytes = activation_bytes(stage, c);
  const auto N = static_cast<std::uint64_t>(n);
  const auto elems = static_cast<std::uint64_t>(c.seq * c.batch * c.hidden);
  const auto P = elems * static_cast<std::uint64_t>(act_bytes);
  const auto H = static_cast<std::uint64_t>(c.hidden);
  const std::uint64_t gain_bus = 2 * ((4 * H * 2 * (N - 1)) / N);  // two all-reduces of [H]
  Traffic r, fwd;  // per layer: the step's traffic, and the forward's share of it
  switch (stage) {
    case 1:
      return r;
    case 2:
      r = {4 * P, 4 * ((P * 2 * (N - 1)) / N), 4};
      fwd = {2 * P, 2 * ((P * 2 * (N - 1)) / N), 2};
      break;
    case 3:
      r = {10 * P + 8 * H, 10 * (P * (N - 1) / N) + gain_bus, 12};
      fwd = {4 * P, 4 * (P * (N - 1) / N), 4};
      break;
    case 4:
    case 5: {
      const std::uint64_t ring = 10 * (N - 1) * (P / N);
      r = {ring + 8 * H, ring + gain_bus, 10 * (N - 1) + 2};
      fwd = {4 * (N - 1) * (P / N), 4 * (N - 1) * (P / N), 4 * (N - 1)};
      break;
    }
    case 6: {
      const std::uint64_t chunk = elems / N;  // elements of one [S/N, B, H] shard
      const auto E = static_cast<std::uint64_t>(act_bytes);
      const std::uint64_t moved = 6 * (N - 1) * chunk * 1 + 4 * (N - 1) * chunk * E;
      const std::uint64_t moved_fwd = 2 * (N - 1) * chunk * 1 + 2 * (N - 1) * chunk * E;
      std::uint64_t amax_payload = 0, amax_bus = 0, fwd_payload = 0, fwd_bus = 0;
      int i = 0;
      for (const std::uint64_t k : {4, 2, 3, 2, 3, 2, 2, 2}) {
        amax_payload += 4 * k;
        amax_bus += (4 * k * 2 * (N - 1)) / N;
        if (i++ < 4) {  // the forward's four
          fwd_payload += 4 * k;
          fwd_bus += (4 * k * 2 * (N - 1)) / N;
        }
      }
      r = {moved + 8 * H + amax_payload, moved + gain_bus + amax_bus, 10 * (N - 1) + 2 + 8};
      fwd = {moved_fwd + fwd_payload, moved_fwd + fwd_bus, 4 * (N - 1) + 4};
      break;
    }
    default:
      throw std::runtime_error(fmt::format("no stage {} (1 … 6)", stage));
  }
  return per_step(c, r, fwd);
}

double layer_params_per_tp_rank(const BlockConfig& c, int tp) {
  check(tp >= 1, "TP ranks must be >= 1");
  const double H = double(c.hidden), KV = double(c.kv_dim()), F = double(c.ffn);
  return (H * (H + 2 * KV) + H * H + 3 * H * F) / tp + 2 * H;
}

double fsdp_bytes(const BlockConfig& c, int tp, int dp, int gather_bytes) {
  check(dp >= 1, "DP ranks must be >= 1");
  const double P = layer_params_per_tp_rank(c, tp), D = dp;
  return double(c.layers) * (2.0 * gather_bytes + 4.0) * P * (D - 1) / D;
}

Traffic fsdp_traffic(const BlockConfig& c, int tp, int dp, int microbatches) {
  check(tp >= 1 && dp >= 1 && microbatches >= 1, "TP, DP ranks and micro-batches must be >= 1");
  using U = std::uint64_t;
  const U D = U(dp), T = U(tp), H = U(c.hidden), KV = U(c.kv_dim()), F = U(c.ffn);
  const U matrix = c.bf16_weight_copies() ? 2 : 4;  // the compute copies' element bytes
  struct Part {
    U rows, cols, size;
  };
  // The TP-local parameters in the order of common/model.h's Param: norm1, wq, wk, wv, wo, norm2,
  // w_gate, w_up, w_down (columns split the out dim, rows the in dim).
  const std::array<Part, 9> parts = {
      Part{H, 1, 4},           Part{H, H / T, matrix}, Part{H, KV / T, matrix},
      Part{H, KV / T, matrix}, Part{H / T, H, matrix}, Part{H, 1, 4},
      Part{H, F / T, matrix},  Part{H, F / T, matrix}, Part{F / T, H, matrix}};
  U gather = 0, numel = 0;  // one rank's packed part (bytes) and flat shard (elements)
  for (const Part& p : parts) {
    const U shard = (p.rows + D - 1) / D * p.cols;
    gather = (gather + p.size - 1) / p.size * p.size + shard * p.size;
    numel += shard;
  }
  auto ring = [&](U payload) { return payload * (D - 1) / D; };
  const U gathered = D * gather, reduced = D * numel * 4;
  const U L = U(c.layers), G = 2 * U(microbatches);  // gathers per layer and step
  return {L * (G * gathered + reduced), L * (G * ring(gathered) + ring(reduced)), L * (G + 1)};
}

Traffic cp_traffic(const BlockConfig& c, int dp, int cp, int tp, CpMethod method) {
  check(dp >= 1 && cp >= 1 && tp >= 1, "DP, CP and TP ranks must be >= 1");
  if (cp == 1) return {};
  using U = std::uint64_t;
  // E: K/V, q and the output move at the activations' element size (2 under bf16); G: the dK/dV
  // partial sums of the ring and the all-gather's reduce-scatter stay fp32 in every recipe.
  const U C = U(cp), E = U(activation_bytes(8, c)), G = 4, Dh = U(c.head_dim());
  const U rows = U(c.seq) / C * (U(c.batch) / U(dp));  // the rank's tokens × its sequences
  const U kv = rows * (U(c.kv_heads_or_heads()) / U(tp)) * Dh;
  const U q = rows * (U(c.heads) / U(tp)) * Dh;
  Traffic layer, fwd;
  switch (method) {
    case CpMethod::ring: {
      const U hop = 2 * kv * E, dhop = 2 * kv * G;  // K and V packed; dK and dV packed
      fwd = {(C - 1) * hop, (C - 1) * hop, C - 1};  // K/V: C − 1 hops
      layer = fwd;
      layer += {(C - 1) * hop + C * dhop, (C - 1) * hop + C * dhop, (C - 1) + C};  // K/V, dK/dV
      break;
    }
    case CpMethod::allgather: {
      const U all = C * 2 * kv * E, dall = C * 2 * kv * G;  // gathered K/V, reduce-scattered dK/dV
      const Traffic one{all, all * (C - 1) / C, 1};
      fwd = one;
      layer = one;                             // forward: the gather
      layer += one;                            // backward: the gather again
      layer += {dall, dall * (C - 1) / C, 1};  // and the reduce-scatter of dK/dV
      break;
    }
    case CpMethod::ulysses: {
      // An all-to-all of a tensor of n elements: C − 1 sendrecv steps of n/C elements.
      auto a2a = [&](U n) { return Traffic{(C - 1) * (n / C) * E, (C - 1) * (n / C) * E, C - 1}; };
      for (const U n : {q, kv, kv, q}) fwd += a2a(n);  // q, k, v there; the output back
      layer = fwd;
      for (const U n : {q, kv, kv, q, q, q, kv, kv}) layer += a2a(n);  // q k v out dO; dq dk dv
      break;
    }
  }
  return per_step(c, layer, fwd);
}

MeshTraffic mesh_traffic(const BlockConfig& c, int dp, int cp, int tp, CpMethod method) {
  check(dp >= 1 && cp >= 1 && tp >= 1, "DP, CP and TP ranks must be >= 1");
  BlockConfig local = c;  // what one rank's stage 05 sees: S / C tokens of B / D sequences
  local.seq = c.seq / cp;
  local.batch = c.batch / dp;
  return {comm_bytes(5, local, tp), cp_traffic(c, dp, cp, tp, method),
          fsdp_traffic(c, tp, dp * cp)};
}

}  // namespace tpx
