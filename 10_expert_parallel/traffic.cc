#include "10_expert_parallel/traffic.h"

#include <algorithm>

#include <fmt/format.h>

#include "04_overlap_ring/traffic.h"
#include "07_fsdp_tp/traffic.h"
#include "08_context_parallel/traffic.h"
#include "common/moe.h"
#include "common/moe_ep.h"

namespace tpx::ep {
namespace {

using U = std::uint64_t;

/// An all_reduce of `bytes` over `n` ranks as the communicator counts it (none on one rank).
Traffic all_reduce(U bytes, U n) {
  if (n <= 1 || bytes == 0) return {};
  return {bytes, bytes * 2 * (n - 1) / n, 1};
}

/// An all_gather or reduce_scatter whose whole buffer is `bytes`, over `n` ranks.
Traffic gather(U bytes, U n) {
  return {bytes, bytes * (n - 1) / n, 1};
}

}  // namespace

std::int64_t moe_layers(const BlockConfig& c) {
  return c.moe.experts > 0 ? (c.layers + c.moe.every - 1) / c.moe.every : 0;
}

MoeTokenOrder cp_token_order(int dp, int cp, std::int64_t b) {
  if (cp == 1) return {};
  MoeTokenOrder order{.pieces = 2 * b, .keys = {}};
  for (int q = 0; q < dp * cp; ++q)
    for (std::int64_t p = 0; p < 2 * b; ++p) {
      const int d = q / cp, c = q % cp;
      const std::int64_t chunk = p % 2 == 0 ? c : 2 * cp - 1 - c;
      order.keys.push_back((std::int64_t(d) * b + p / 2) * 2 * cp + chunk);
    }
  return order;
}

std::vector<std::vector<U>> balanced_kept_rows(const BlockConfig& c, int dp, int ep, int group,
                                               int cp) {
  const MoeConfig& m = c.moe;
  const int ranks = dp * cp;  // the token group
  require_formula(
      dp >= 1 && cp >= 1 && ep >= 1 && ranks % ep == 0 && m.experts % ep == 0 && c.batch % dp == 0,
      "EP divides D·C and E, D divides B");
  const std::int64_t n = c.seq * c.batch / ranks, E = m.experts, K = m.topk;
  require_formula((n * K) % E == 0,
                  "balanced routing: each rank's S·B/(D·C)·K assignments a multiple of E");
  const MoeTokenOrder order = cp_token_order(dp, cp, c.batch / dp);
  const std::int64_t P = order.pieces, L = n / P;  // runs a rank, tokens a run
  const bool dropless = m.capacity_factor <= 0.0;
  require_formula(dropless || (L * K) % E == 0,
                  "balanced routing with a capacity: each run's tokens·K a multiple of E");
  const std::int64_t cap = moe_capacity(m.shape(c.hidden, c.seq * c.batch));
  std::vector<std::vector<U>> rows(std::size_t(ep), std::vector<U>(std::size_t(ep), 0));
  for (int s = 0; s < ep; ++s) {
    const std::int64_t q = std::int64_t(group) * ep + s;  // the rank's place in the token group
    std::int64_t kept = dropless ? n * K / E : 0;         // per expert
    for (std::int64_t p = 0; p < P && !dropless; ++p) {
      const std::int64_t place =
          order.keys.empty() ? q * P + p : order.keys[std::size_t(q * P + p)];
      kept += std::clamp<std::int64_t>(cap - place * L * K / E, 0, L * K / E);
    }
    for (int d = 0; d < ep; ++d) rows[std::size_t(s)][std::size_t(d)] = U(kept * (E / ep));
  }
  return rows;
}

ExpertLayerTraffic expert_layer_traffic(const BlockConfig& group, int dp, int tp, int ep,
                                        int dp_cp_index, int cp) {
  require_formula(dp >= 1 && cp >= 1 && tp >= 1 && ep >= 1 && (dp * cp) % ep == 0,
                  "EP divides D·C");
  const MoeConfig& m = group.moe;
  const U NT = U(dp) * U(cp), T = U(tp), G = NT / U(ep);  // the token group, the holders
  const U H = U(group.hidden), E = U(m.experts), n = U(group.seq * group.batch) / NT;
  BlockConfig local = group;  // stage 05 inside the TP group, on S/C tokens of B/D sequences
  local.seq /= cp;
  local.batch /= dp;
  ExpertLayerTraffic t;
  const U chunks = (T - 1) * (stream_bytes(local, 4) / T);
  t.swiglu = {5 * chunks, 5 * chunks, 5 * (T - 1)};
  if (T > 1) {
    const U P = n * H * 4;
    for (int i = 0; i < 4; ++i) t.tp += gather(P, T);  // tokens and dy in, output and dx out
    t.tp += all_reduce(n * U(m.topk) * 4, T);          // the gate weights' gradients
  }
  // EP and the counts: moe_ep_traffic of the balanced rows, the counts over the token group,
  // per run of tokens (cp_token_order).
  const MoeEpTraffic x = moe_ep_traffic(balanced_kept_rows(group, dp, ep, dp_cp_index / ep, cp),
                                        dp_cp_index % ep, m.experts, H * 4, int(NT), int(m.chunks),
                                        cp_token_order(dp, cp, group.batch / dp).pieces);
  t.counts = x.counts;
  t.ep = x.forward;
  t.ep -= x.counts;
  t.ep += x.backward;
  const U FE = U(m.expert_ffn) / T, SF = U(m.shared_ffn) / T, El = E / U(ep);
  t.grads = all_reduce(H * E * 4, NT);  // the router
  if (SF > 0)
    for (int i = 0; i < 3; ++i) t.grads += all_reduce(H * SF * 4, NT);
  if (G > 1) {
    // FSDP over the G holders: the rank's experts packed, 3·El·H·FE/T floats padded to a
    // multiple of G, gathered for the forward and again for the backward, and their gradients
    // reduce-scattered once per step.
    const U packed = (3 * El * H * FE + G - 1) / G * G * 4;
    t.gathers = gather(packed, G);
    t.gathers += gather(packed, G);
    t.grads += gather(packed, G);
  }
  return t;
}

ExpertTraffic expert_traffic(const BlockConfig& c, int dp, int tp, int ep, int dp_cp_index, int cp,
                             cp::CpMethod method) {
  const U Lm = U(moe_layers(c)), Ld = U(c.layers) - Lm;
  const int ranks = dp * cp;  // FSDP's, the token group
  BlockConfig local = c;      // stage 05 inside the TP group, on S/C tokens of B/D sequences
  local.seq /= cp;
  local.batch /= dp;
  const ExpertLayerTraffic layer = expert_layer_traffic(c, dp, tp, ep, dp_cp_index, cp);
  ExpertTraffic t;
  // TP: stage 05's, each MoE layer's five SwiGLU primitives replaced by the experts' collectives.
  t.tp = ring::traffic(local, tp);
  t.tp -= layer.swiglu * Lm;
  // DP (× CP): FSDP's of the dense parameters (a MoE layer's SwiGLU empty), the language model's
  // ends, and per MoE layer the counts and the experts' gradients.
  BlockConfig dense = c, moe = c;
  dense.layers = std::int64_t(Ld);
  moe.layers = std::int64_t(Lm);
  moe.ffn = 0;
  t.dp = fsdp::fsdp_traffic(dense, tp, ranks);
  t.dp += fsdp::fsdp_traffic(moe, tp, ranks);
  t.dp += lm_grads_traffic(c, tp, ranks, true, true);
  t.cp = cp::cp_traffic(c, dp, cp, tp, method);
  for (U l = 0; l < Lm; ++l) {
    t.tp += layer.tp;
    t.ep += layer.ep;
    t.dp += layer.counts;
    t.dp += layer.gathers;
    t.dp += layer.grads;
  }
  return t;
}

StagePlan pipeline_plan_with_experts(StagePlan p, const BlockConfig& c, const Mesh& mesh, int ep,
                                     int microbatches) {
  std::uint64_t moe = 0;  // the rank's MoE layers
  for (const std::int64_t l : p.sharding.layers) moe += c.moe.layer(l) ? 1 : 0;
  const auto M = std::uint64_t(microbatches);
  BlockConfig group = c;
  group.batch = c.batch / microbatches;
  const ExpertLayerTraffic x =
      expert_layer_traffic(group, mesh.dp, mesh.tp, ep, mesh.dp_cp_index(), mesh.cp);
  Traffic tp = p.traffic;  // what the named groups leave is the TP group's
  for (const PlanGroup& g : p.groups) tp -= g.traffic;
  tp -= x.swiglu * (M * moe);
  tp += x.tp * (M * moe);
  // FSDP's gathers and reduce-scatter of the MoE layers' SwiGLU, which they do not have.
  BlockConfig with = c, without = c;
  with.layers = without.layers = std::int64_t(moe);
  without.ffn = 0;
  for (PlanGroup& g : p.groups)
    if (g.name == "dp") {
      g.traffic -= fsdp::fsdp_traffic(with, mesh.tp, mesh.dp_cp(), microbatches);
      g.traffic += fsdp::fsdp_traffic(without, mesh.tp, mesh.dp_cp(), microbatches);
      g.traffic += x.counts * (M * moe);
      g.traffic += x.gathers * (M * moe);
      g.traffic += x.grads * moe;
    }
  p.groups.push_back({.name = "ep", .label = "ep group", .traffic = x.ep * (M * moe)});
  p.traffic = tp;
  for (const PlanGroup& g : p.groups) p.traffic += g.traffic;
  p.comm += fmt::format(", experts over EP {} (balanced routing)", ep);
  return p;
}

}  // namespace tpx::ep
