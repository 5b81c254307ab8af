#include "08_context_parallel/traffic.h"

#include <cstdint>

#include "04_overlap_ring/traffic.h"
#include "07_fsdp_tp/traffic.h"

namespace tpx::cp {

const char* to_string(CpMethod m) {
  switch (m) {
    case CpMethod::allgather:
      return "allgather";
    case CpMethod::ulysses:
      return "ulysses";
    case CpMethod::ring:
      break;
  }
  return "ring";
}

CpMethod method_of(std::string_view word) {
  return word == "allgather" ? CpMethod::allgather
         : word == "ulysses" ? CpMethod::ulysses
                             : CpMethod::ring;
}

Traffic cp_traffic(const BlockConfig& c, int dp, int cp, int tp, CpMethod method) {
  require_formula(dp >= 1 && cp >= 1 && tp >= 1, "DP, CP and TP ranks must be >= 1");
  if (cp == 1) return {};
  using U = std::uint64_t;
  // E: K/V, q and the output move at the activations' element size (2 under bf16); G: the dK/dV
  // partial sums of the ring and the all-gather's reduce-scatter stay fp32 in every recipe.
  const U C = U(cp), E = U(activation_bytes(c)), G = 4, Dh = U(c.head_dim());
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
  require_formula(dp >= 1 && cp >= 1 && tp >= 1, "DP, CP and TP ranks must be >= 1");
  BlockConfig local = c;  // what one rank's stage 05 sees: S / C tokens of B / D sequences
  local.seq = c.seq / cp;
  local.batch = c.batch / dp;
  Traffic grads = fsdp::fsdp_traffic(c, tp, dp * cp);
  grads += lm_grads_traffic(c, tp, dp * cp, true, true);  // the language model's ends (FSDP)
  return {ring::traffic(local, tp), cp_traffic(c, dp, cp, tp, method), grads};
}

}  // namespace tpx::cp
