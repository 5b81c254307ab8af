#include "07_fsdp_tp/traffic.h"

#include <array>
#include <cstdint>

namespace tpx::fsdp {

double fsdp_bytes(const BlockConfig& c, int tp, int dp, int gather_bytes) {
  require_formula(dp >= 1, "DP ranks must be >= 1");
  const double P = layer_params_per_tp_rank(c, tp), D = dp;
  return double(c.layers) * (2.0 * gather_bytes + 4.0) * P * (D - 1) / D;
}

Traffic fsdp_traffic(const BlockConfig& c, int tp, int dp, int microbatches, bool fp8_gather,
                     std::int64_t keep_last) {
  require_formula(tp >= 1 && dp >= 1 && microbatches >= 1,
                  "TP, DP ranks and micro-batches must be >= 1");
  require_formula(keep_last >= 0 && keep_last <= c.layers, "kept layers must lie in [0, L]");
  if (dp == 1) return {};  // nothing sharded: the stage gathers and reduces nothing
  using U = std::uint64_t;
  const U D = U(dp), T = U(tp), H = U(c.hidden), KV = U(c.kv_dim()), F = U(c.ffn);
  struct Part {
    U rows, cols, size;
  };
  auto ring = [&](U payload) { return payload * (D - 1) / D; };
  const U G = 2 * U(microbatches);  // gathers per layer and step
  // One layer whose matrices are gathered at `matrix` bytes an element.
  auto layer = [&](U matrix) {
    // The TP-local parameters in the order of common/model.h's Param: norm1, wq, wk, wv, wo,
    // norm2, w_gate, w_up, w_down (columns split the out dim, rows the in dim).
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
    const U gathered = D * gather, reduced = D * numel * 4;
    return Traffic{G * gathered + reduced, G * ring(gathered) + ring(reduced), G + 1};
  };
  // The matrices' element bytes as gathered: the compute copies' (bf16 or fp32), or E4M3 codes
  // for the layers that run the recipe under --fp8-weight-gather.
  const U stored = c.bf16_weight_copies() ? 2 : 4;
  const U L = U(c.layers), K = fp8_gather ? U(keep_last) : 0;
  Traffic t = layer(fp8_gather ? 1 : stored) * (L - K);
  t += layer(stored) * K;
  if (fp8_gather) {  // the seven amaxes agreed over the mesh before each FP8 gather
    const U W = T * D, amax = 7 * 4;
    t += Traffic{amax, amax * 2 * (W - 1) / W, 1} * ((L - K) * G);
  }
  return t;
}

}  // namespace tpx::fsdp
