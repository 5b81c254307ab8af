// What a memory estimate's terms are written in: the checked arithmetic, the bytes of a rank's
// tensors named as in the chapters, and the registration through which a stage adds the terms of
// its own dimension of the mesh. The shared terms (parameters, gradients, saved activations,
// target, temporaries, weight copies, optimizer state) are common/memory.cc's; a stage's own are
// in its folder and reach the estimate through Sharding::dimensions:
//   07_fsdp_tp/memory.cc            unsharded layers (FSDP), stages 07, 08 and 09
//   08_context_parallel/memory.cc   CP attention buffers, stages 08 and 09
//   09_pipeline_parallel/memory.cc  the pipeline's buffers and host terms, stage 09
//
// defines: tpx::memory::Count, tpx::memory::sum(), tpx::memory::product(),
//          tpx::memory::largest(), tpx::memory::ActivationBytes, tpx::memory::LayerElements,
//          tpx::memory::saved_layer_bytes(), tpx::memory::cheap_bytes(), tpx::MemoryParts,
//          tpx::MemoryDimension
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string_view>

#include "config.h"
#include "memory.h"
#include "model.h"

namespace tpx {
namespace memory {

using Count = std::int64_t;

inline constexpr Count kF32 = 4;   // master weights, gradients, optimizer state, statistics
inline constexpr Count kBf16 = 2;  // activations under the recipe, weights' compute copies

/// The sum of non-negative counts; SizeOverflow naming `what` if it does not fit in int64.
Count sum(std::initializer_list<Count> parts, std::string_view what);
/// The product of non-negative counts; SizeOverflow naming `what` if it does not fit in int64.
Count product(std::initializer_list<Count> factors, std::string_view what);
/// The largest of the moments' live bytes.
Count largest(std::initializer_list<Count> moments);

/// Bytes of this rank's tensors, named as in the chapters (N ranks; /N only where the sharding
/// splits). Activations take e = c.activations()'s bytes per element (4, or 2 under --dtype bf16
/// / fp8); statistics and weights are fp32.
struct ActivationBytes {
  Count e;         ///< an activation element's bytes
  Count stream;    ///< R: the residual stream [S, B, H], or [S/N, B, H] with sequence parallelism
  Count rows;      ///< an RMSNorm's rstd, one float per row of the stream
  Count full;      ///< G: [S, B, H], every token: a region's gathered input or partial output
  Count gather;    ///< G with sequence parallelism (f and g all-gather into a new tensor), else 0
  Count cols_h;    ///< [S, B, H/N]: q, a and their gradients
  Count cols_kv;   ///< [S, B, NKV·D/N]: k, v and their gradients (cols_h without GQA)
  Count cols_f;    ///< [S, B, F/N]: gate, up, s and their gradients
  Count probs;     ///< [B, NH/N, S, S]: naive attention's probabilities
  Count lse;       ///< [B, NH/N, S]: fused attention's log-sum-exp per query row
  Count attn;      ///< what attention keeps for backward: lse (fused) or probs (naive)
  Count dq_turns;  ///< the fused CUDA backward's turn counters: 1 + B·NH/N·⌈S/32⌉ words
  Count w_h;       ///< a local Wq / Wo: H·H/N elements (bytes at fp32)
  Count w_kv;      ///< a local Wk / Wv: H·NKV·D/N elements
  Count w_f;       ///< a local Wg / Wu / Wd: H·F/N elements (bytes at fp32)
};

/// One layer's parameter elements: the nine tensors, this rank's shards. Under FSDP (D·C shards
/// of the DP×CP group) each TP shard [rows, ...] is split on dim 0 into D·C shards of
/// ⌈rows / (D·C)⌉ rows (padded): the rank keeps one (`kept`); `tp` counts the unsharded TP shard.
struct LayerElements {
  Count kept = 0;
  Count tp = 0;
};

/// Per layer, as BlockActivations: x, h, x2, h2 (the stream; h and h2 as the stage keeps them:
/// this rank's part of the stream, never the gathered copy), rstd1, rstd2, q, k, v, a, gate, up,
/// s, and probs (naive attention) or lse (fused).
Count saved_layer_bytes(const BlockConfig& c, const ActivationBytes& b);
/// What --recompute selective makes again instead of keeping: h, h2 (as kept), rstd1, rstd2, s.
Count cheap_bytes(const BlockConfig& c, const ActivationBytes& b);

}  // namespace memory

/// What the shared terms were computed from, for a dimension's own terms.
struct MemoryParts {
  const BlockConfig& global;  ///< the run's config
  BlockConfig rank;           ///< the rank's block: its S / C tokens, its layers
  BlockConfig pass;           ///< what one pass's activations are made of (a micro-batch)
  memory::ActivationBytes rank_bytes, pass_bytes;
  memory::LayerElements layer;  ///< one layer's parameter elements
  memory::Count temporaries;    ///< the "largest temporaries" term
  const Sharding& sharding;
};

/// A stage's dimension of the mesh as the estimate sees it: how it cuts the rank's block before
/// the shared terms are computed, and the terms it adds after them. A stage puts its dimension in
/// its Parallelism's sharding() (Sharding::dimensions), after those of the stages it runs inside
/// it, so the estimate lists the terms in the order of the mesh (FSDP, CP, pipeline).
class MemoryDimension {
 public:
  virtual ~MemoryDimension() = default;
  /// Cuts the rank's block and one pass's block (a pipeline: its layers, one micro-batch of the
  /// batch); tpx::Error when the estimate cannot be made for them.
  virtual void cut(BlockConfig& /*rank*/, BlockConfig& /*pass*/, const Sharding& /*s*/) const {}
  /// Adds the dimension's terms to `e`, which holds the shared terms and those of the dimensions
  /// before it (and may change a shared term the dimension keeps otherwise).
  virtual void add_terms(MemoryEstimate& e, const MemoryParts& p) const = 0;
};

}  // namespace tpx
