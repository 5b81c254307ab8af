#include "06_fp8/traffic.h"

#include <array>
#include <cstdint>

#include "03_sequence_parallel/traffic.h"

namespace tpx::async_fp8 {

Traffic traffic(const BlockConfig& c, int n, int act_bytes) {
  return recipe_traffic(c, n, act_bytes, lowp::Recipe::tensorwise);
}

Traffic recipe_traffic(const BlockConfig& c, int n, int act_bytes, lowp::Recipe recipe,
                       Fp8Weights weights, std::int64_t keep_last) {
  require_formula(n >= 1, "ranks must be >= 1");
  require_formula(keep_last >= 0 && keep_last <= c.layers, "kept layers must lie in [0, L]");
  using U = std::uint64_t;
  const U N = U(n), e = U(act_bytes == 0 ? 2 : act_bytes);
  const U chunk = U(c.seq * c.batch * c.hidden) / N;  // elements of one [S/N, B, H] shard
  // A gathered chunk's scales: none under tensorwise (the agreed scale travels with no chunk),
  // one fp32 per row of H under rowwise, one fp32 per 128 of a row under block128, one E8M0 byte
  // per 32 of a row under mxfp8, one UE4M3 byte per 16 under nvfp4 (its tensor scale travels
  // with no chunk either); each scale gather is a second ring of N − 1 transfers. The codes are a
  // byte each, nvfp4's half a byte (H is even).
  const U rows = U(c.seq * c.batch) / N;
  const bool nvfp4 = recipe == lowp::Recipe::nvfp4;
  const U per_row = recipe == lowp::Recipe::rowwise    ? 1
                    : recipe == lowp::Recipe::block128 ? (U(c.hidden) + 127) / 128
                    : recipe == lowp::Recipe::mxfp8    ? (U(c.hidden) + 31) / 32
                    : nvfp4                            ? (U(c.hidden) + 15) / 16
                                                       : 0;
  const U scale_bytes = recipe == lowp::Recipe::mxfp8 || nvfp4 ? 1 : 4;
  const U scales = scale_bytes * rows * per_row, rings = per_row > 0 ? 2 : 1;
  const U codes = nvfp4 ? chunk / 2 : chunk;
  const U moved = 6 * (N - 1) * (codes + scales) + 4 * (N - 1) * chunk * e;
  const U moved_fwd = 2 * (N - 1) * (codes + scales) + 2 * (N - 1) * chunk * e;
  Traffic amax, amax_fwd;  // the eight MAX all-reduces, and the forward's four (tensorwise, nvfp4)
  // Forward: qkv (h, Wq, Wk, Wv), o (a, Wo), gate/up (h2, Wg, Wu), down (s, Wd); backward:
  // qkv (3 gradients), o (a, its gradient), gate/up (2 gradients), down (s, its gradient), each
  // with its weights when they are requantized. nvfp4 quantizes every weight again in backward,
  // agrees the input's tensor amax again there too (the column layers' re-gathered input, the
  // row layers' input of the dW GEMM, after its Hadamard transform), and the column layers'
  // gradients once more after theirs: qkv 3 + 3 + 1 + 3, o 3, gate/up 2 + 2 + 1 + 2, down 3.
  const bool again = weights == Fp8Weights::requantized,
             given = weights == Fp8Weights::gathered;  // no weight's amax at all
  const std::array<U, 8> ks =
      nvfp4 ? std::array<U, 8>{4, 2, 3, 2, 10, 3, 7, 3}
            : std::array<U, 8>{given ? 1U : 4U, given ? 1U : 2U, given ? 1U : 3U, given ? 1U : 2U,
                               again ? 6U : 3U, again ? 3U : 2U, again ? 4U : 2U, again ? 3U : 2U};
  const bool agreed = recipe == lowp::Recipe::tensorwise || nvfp4;
  int i = 0;
  for (const U k : ks) {
    const Traffic one{4 * k, (4 * k * 2 * (N - 1)) / N, 1};
    if (agreed) amax += one;
    if (agreed && i < 4) amax_fwd += one;
    ++i;
  }
  Traffic layer{moved, moved, (6 * rings + 4) * (N - 1)};
  layer += sp::gain_all_reduces(c, n);
  layer += amax;
  Traffic fwd{moved_fwd, moved_fwd, (2 * rings + 2) * (N - 1)};
  fwd += amax_fwd;
  // The kept layers: stage 05's ring at e, as ring::traffic counts a layer.
  const U ring = (N - 1) * (U(c.seq * c.batch * c.hidden) * e / N);
  Traffic kept_layer{10 * ring, 10 * ring, 10 * (N - 1)};
  kept_layer += sp::gain_all_reduces(c, n);
  const Traffic kept_fwd{4 * ring, 4 * ring, 4 * (N - 1)};
  // Layers [0, L − K) run the recipe and [L − K, L) do not; per_step counts each range's
  // recomputed layers (l % K' == 0) from its own first layer, so count them here.
  auto recomputed = [&](std::int64_t first, std::int64_t end) {
    std::int64_t r = 0;
    for (std::int64_t l = first; l < end; ++l) r += c.recomputes_layer(l) ? 1 : 0;
    return U(r);
  };
  const std::int64_t L = c.layers, Q = L - keep_last;
  Traffic step = layer * U(Q);
  step += fwd * recomputed(0, Q);
  step += kept_layer * U(keep_last);
  step += kept_fwd * recomputed(Q, L);
  step += lm_traffic(c, n, act_bytes, TpLayout::ring);  // the language model's ends
  return step;
}

}  // namespace tpx::async_fp8
