// The parameters of L stacked blocks, their gradients, and how tensor parallelism shards them.
//
// defines: tpx::Param, tpx::Split, tpx::LayerParams, tpx::Sharding, tpx::VocabShard,
//          tpx::vocab_shard(), tpx::LmParams, tpx::Model,
//          tpx::make_data(), tpx::make_model()
#pragma once

#include <array>
#include <cstdint>
#include <memory>
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

class MemoryDimension;  // common/memory_terms.h

/// Which part of the model this rank holds. Stage 01: the default (everything).
struct Sharding {
  int rank = 0;
  int world = 1;
  bool weights = false;   ///< tensor parallel: weights split by param_split()
  bool sequence = false;  ///< sequence parallel: input/target/activations split along S
  /// The mesh's data-parallel degree D (stages 07-09): D replicas, each training B / D, each
  /// parameter's TP shard split on dim 0 over the D·C ranks of the DP×CP group (padded). rank and
  /// world above are the rank's place in its TP group.
  int dp = 1;
  /// The mesh's context-parallel degree C (stages 08, 09): the sequence split over C ranks as well
  /// (S / (C·T) tokens per rank under SP).
  int cp = 1;
  /// The mesh's pipeline degree P (stage 09).
  int pp = 1;
  /// This rank's index in its DP×CP group, whose D·C ranks each hold ⌈rows / (D·C)⌉ of every
  /// TP-local tensor's dim 0 (FSDP, stages 07-09).
  int dp_cp_index = 0;
  /// The layers this rank holds, as indices into the whole model (a pipeline stage's; empty:
  /// every layer), and whether it holds the language model's embedding and its head (the final
  /// gain and the output layer): the checkpoint's cut (common/checkpoint.h).
  std::vector<std::int64_t> layers = {};
  bool embedding = true, head = true;
  /// The stages' own parts of the memory estimate, in the order of the mesh (FSDP, CP, pipeline):
  /// each cuts the rank's block and adds its terms (common/memory_terms.h).
  std::vector<std::shared_ptr<const MemoryDimension>> dimensions = {};
};

/// Shape of this rank's shard of parameter p.
std::vector<std::int64_t> param_local_shape(Param p, const BlockConfig& c, const Sharding& s);
/// Where that shard starts in the full tensor, per dim: its rank's slice of the split dim (the
/// cut the initialiser draws each shard from, and the box a checkpoint records).
std::vector<std::int64_t> param_offset(Param p, const BlockConfig& c, const Sharding& s);

/// The language model's vocabulary cut over the tensor-parallel group (DESIGN.md, "The language
/// model around the block"): V padded up to a multiple of T, as Megatron pads it, each rank holding
/// the contiguous ids [begin, begin + local). Ids ≥ V are padding: embedding rows never looked up,
/// output columns whose logits the cross-entropy skips, all zero.
struct VocabShard {
  std::int64_t begin = 0, local = 0, padded = 0;
  /// How many of the `local` ids are real ones (< vocab): the rest are padding (0 on a rank
  /// whose range lies wholly past the vocabulary).
  std::int64_t real(std::int64_t vocab) const {
    return vocab - begin < 0 ? 0 : (vocab - begin < local ? vocab - begin : local);
  }
};
VocabShard vocab_shard(const BlockConfig& c, const Sharding& s);

/// The language model's parameters outside the blocks, this rank's part: the embedding's rows
/// [local, H], the final RMSNorm's gain [H] (replicated) and the output layer's columns
/// [H, local] (untied, as Llama 3). Undefined under --task block.
struct LmParams {
  Tensor embedding, norm_f, w_out;
  /// The three in --dump's order (kLmParamNames).
  std::array<const Tensor*, 3> all() const { return {&embedding, &norm_f, &w_out}; }
};
inline constexpr int kLmParams = 3;
inline constexpr std::array<std::string_view, kLmParams> kLmParamNames = {"embedding", "norm_f",
                                                                          "w_out"};
/// How the TP group splits each: the embedding's rows and the output layer's columns over the
/// vocabulary, the final gain replicated.
inline constexpr std::array<Split, kLmParams> kLmSplits = {Split::rows, Split::replicated,
                                                           Split::columns};

/// This rank's parameters, gradient buffers, input and target, on c.device.
struct Model {
  std::vector<LayerParams> params;
  std::vector<LayerParams> grads;
  Tensor input;           ///< x, [S, B, H] or its sequence shard (--task block)
  Tensor target;          ///< T, same layout as input (--task block)
  LmParams lm, lm_grads;  ///< --task lm
};

/// Rows [begin, end) of the sequence of the input x (or, with `target`, of the target T):
/// [end − begin, B, H] on c.device, equal to those rows of the whole tensor.
Tensor make_data(const BlockConfig& c, bool target, std::int64_t begin, std::int64_t end);

/// Builds this rank's shard with the counter-based initialiser: weights ~ N(0, 0.02²), gains = 1,
/// x and T ~ N(0, 1) (--task block), or the embedding and output layer ~ N(0, 0.02²) and the final
/// gain 1 (--task lm). Every shard equals the same slice of the unsharded model.
Model make_model(const BlockConfig& c, const Sharding& s);
/// The same, holding only the listed layers (indices into the whole model, in the order given):
/// a pipeline stage's part (stage 09). Each layer's tensors equal make_model's for that index.
Model make_model(const BlockConfig& c, const Sharding& s, const std::vector<std::int64_t>& layers);

}  // namespace tpx
