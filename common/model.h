// The parameters of L stacked blocks, their gradients, and how tensor parallelism shards them.
//
// defines: tpx::Param, tpx::Split, tpx::LayerParams, tpx::CpMethod, tpx::Sharding, tpx::Model,
//          tpx::make_data(), tpx::make_model()
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include "config.h"
#include "tensor.h"

namespace tpx {

/// The nine parameters of one block, in the order of DESIGN.md's --dump file list.
enum class Param : int { norm1, wq, wk, wv, wo, norm2, w_gate, w_up, w_down };
inline constexpr int kNumParams = 9;
inline constexpr std::array<Param, kNumParams> kAllParams = {
    Param::norm1, Param::wq,     Param::wk,   Param::wv,    Param::wo,
    Param::norm2, Param::w_gate, Param::w_up, Param::w_down};

std::string_view param_name(Param p);  ///< "norm1", "wq", ..., "w_down"

/// How tensor parallelism splits a parameter: norm gains are replicated, column-parallel weights
/// (Wq, Wk, Wv, Wg, Wu) split their `out` dim, row-parallel weights (Wo, Wd) their `in` dim.
enum class Split { replicated, columns, rows };
Split param_split(Param p);

/// Full (unsharded) shape of a parameter: [H] for gains, [in, out] for weights ([H, NKV·D] for
/// Wk and Wv).
std::vector<std::int64_t> param_shape(Param p, const BlockConfig& c);

/// One block's parameters (or gradients), indexable by Param.
struct LayerParams {
  std::array<Tensor, kNumParams> t;
  Tensor& operator[](Param p) { return t[static_cast<std::size_t>(p)]; }
  const Tensor& operator[](Param p) const { return t[static_cast<std::size_t>(p)]; }
};

/// How stage 08's attention reaches the keys of the other CP ranks (--cp-method).
enum class CpMethod {
  ring,       ///< K/V blocks passed around the CP ring, merged by log-sum-exp
  allgather,  ///< K and V all-gathered over CP; dK, dV reduce-scattered
  ulysses,    ///< all-to-all to head-sharded full-sequence q, k, v and back (DeepSpeed Ulysses)
};

/// Which part of the model this rank holds. Stage 01: the default (everything).
struct Sharding {
  int rank = 0;
  int world = 1;
  bool weights = false;   ///< tensor parallel: weights split by param_split()
  bool sequence = false;  ///< sequence parallel: input/target/activations split along S
  /// Data parallel with sharded parameters (stage 07's FSDP): D replicas, each training B / D,
  /// each parameter's TP shard split on dim 0 over them (padded). rank and world above are the
  /// rank's place in its TP group.
  int dp = 1;
  /// Context parallelism (stage 08): the sequence split over C ranks as well (S / (C·T) tokens
  /// per rank under SP); the parameters are sharded over D·C ranks.
  int cp = 1;
  CpMethod cp_method = CpMethod::ring;
  /// Pipeline parallelism (stage 09): P stages, this rank holding `pp_layers` of the L layers
  /// (0: all of them), its batch part trained in `microbatches` parts, and at most
  /// `pp_live_layers` (micro-batch, layer) activations alive at once (its schedule's peak).
  /// `pp_split_backward`: the schedule splits the backward (zb-h1), so the dW GEMMs' inputs of
  /// the micro-batches between their B and W are kept too.
  /// `pp_loss_grads`: the most micro-batches whose loss gradient waits for their backward (the
  /// last stage's live count; 0 elsewhere). The first stage keeps the input's micro-batches, the
  /// last the target's. `pp_live_passes`: the most (micro-batch, virtual stage) passes alive at
  /// once (each of them pp_layers / stages-per-rank layers of pp_live_layers).
  /// `pp_live_kept_layers`: the most of those (micro-batch, layer) pairs whose layer keeps its
  /// activations whole between its forward and its backward (all of them but the layers that
  /// --recompute full makes again, which keep only their input).
  int pp = 1;
  std::int64_t pp_layers = 0;
  int microbatches = 1;
  std::int64_t pp_live_layers = 0;
  std::int64_t pp_live_passes = 0;
  std::int64_t pp_live_kept_layers = 0;
  bool pp_split_backward = false;
  std::int64_t pp_loss_grads = 0;
  bool pp_holds_input = false, pp_holds_target = false;
};

/// Shape of this rank's shard of parameter p.
std::vector<std::int64_t> param_local_shape(Param p, const BlockConfig& c, const Sharding& s);

/// This rank's parameters, gradient buffers, input and target, on c.device.
struct Model {
  std::vector<LayerParams> params;
  std::vector<LayerParams> grads;
  Tensor input;   ///< x, [S, B, H] or its sequence shard
  Tensor target;  ///< T, same layout as input
};

/// Rows [begin, end) of the sequence of the input x (or, with `target`, of the target T):
/// [end − begin, B, H] on c.device, equal to those rows of the whole tensor.
Tensor make_data(const BlockConfig& c, bool target, std::int64_t begin, std::int64_t end);

/// Builds this rank's shard with the counter-based initialiser: weights ~ N(0, 0.02²), gains = 1,
/// x and T ~ N(0, 1). Every shard equals the same slice of the unsharded model.
Model make_model(const BlockConfig& c, const Sharding& s);
/// The same, holding only the listed layers (indices into the whole model, in the order given):
/// a pipeline stage's part (stage 09). Each layer's tensors equal make_model's for that index.
Model make_model(const BlockConfig& c, const Sharding& s, const std::vector<std::int64_t>& layers);

}  // namespace tpx
