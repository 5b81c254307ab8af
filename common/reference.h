// The oracle: a deliberately plain double-precision implementation of the stacked block, forward,
// backward and SGD, in loops. It shares no compute code with the stages (only the initialiser, so
// it sees the same numbers); tests and `01_baseline --check` compare against it.
//
// With a low-precision recipe (LowpEmulation) it emulates stage 06's GEMMs under --fp8-recipe: at
// each of the seven linear layers' three GEMMs (forward, input gradient, weight gradient) both
// operands go through common/lowp.h's quantizer as the stage quantizes them (the same element
// format, the same blocks along the same reduction dimension), are dequantized, and multiplied
// in double. Everything between the GEMMs, and the language model's output layer, stays in double.
//
// Under c.moe (stage 10) the layers it names have the mixture of experts of common/moe.h as their
// MLP, in double over all the step's tokens in sequence order (common/moe_model.h), the auxiliary
// loss added to the loss and the balancing bias moved after each step.
//
// defines: tpx::ReferenceRun, tpx::ReferenceState, tpx::LowpEmulation, tpx::reference_init(),
//          tpx::reference_run(), tpx::reference_run_lowp(), tpx::reference_run_from()
#pragma once

#include <array>
#include <optional>
#include <vector>

#include "config.h"
#include "lowp.h"
#include "model.h"
#include "named.h"

namespace tpx {

struct ReferenceRun {
  // From the first forward + backward, before any update (all unsharded, C order).
  std::vector<double> output;                                      ///< [S, B, H]
  std::vector<double> input_grad;                                  ///< [S, B, H]
  std::vector<std::array<std::vector<double>, kNumParams>> grads;  ///< [layer][param]
  /// --task lm: the gradients of the embedding, the final gain and the output layer.
  std::array<std::vector<double>, kLmParams> lm_grads;
  /// losses[i]: the loss after i SGD updates.
  std::vector<double> losses;
  /// Stage 10: the MoE layers' parameter gradients from the first step, under
  /// moe_tensor_names() (common/moe_model.h). A MoE layer's dense w_gate, w_up and w_down do not
  /// exist: their entries in `grads` are empty.
  std::vector<NamedArray<double>> extra_grads;
};

/// A starting point of the reference: input, target and every layer's parameters (unsharded).
struct ReferenceState {
  std::vector<double> input, target;              // [S, B, H] (--task block)
  std::array<std::vector<double>, kLmParams> lm;  ///< --task lm: E [V, H], norm_f [H], W_out [H, V]
  std::vector<std::array<std::vector<double>, kNumParams>> params;  ///< [layer][param]
};

/// The recipe the reference emulates, and the tensor-parallel group it emulates it over.
struct LowpEmulation {
  lowp::Recipe recipe = lowp::Recipe::tensorwise;
  /// The ranks N of the group. Where the stage's GEMM has its reduction dimension K sharded (the
  /// row-parallel layers' forward, K = in/N; the column-parallel layers' input gradient,
  /// K = out/N), each rank quantizes its own part of K: a rowwise scale covers 1/N of a row.
  /// Under the block recipes a block never crosses a shard's edge (06_fp8/layers.h), and
  /// tensorwise agrees one scale over the group, so N changes nothing there.
  int ranks = 1;
  /// The data-parallel replicas D (stage 07's mesh): replica d trains batch columns
  /// [d·B/D, (d+1)·B/D) and quantizes its own tokens. A weight-gradient GEMM reduces over the
  /// tokens, so under the row and block recipes (whose blocks run along the tokens there) each
  /// replica's tokens, in their [S, B/D] order, are quantized apart and the replicas' products
  /// summed, as the reduce-scatter of FSDP sums them. Every other GEMM's blocks lie inside one
  /// token row, which no replica cuts, and tensorwise is checked against the plain reference.
  /// nvfp4's per-tensor scale is the amax of what one replica's TP group holds, so under nvfp4
  /// every token operand (an activation or a gradient) is quantized replica by replica.
  int replicas = 1;
  /// Whether the stage holds its activations and their gradients in bf16 (under --dtype fp8:
  /// BlockConfig::activations()). Then every token operand the stage quantizes from a value it
  /// stored (not from a gathered operand's dequantized codes) is rounded to bf16 first, as the
  /// stage's was: the two then quantize the same bf16 values, and a code differs only where the
  /// stage's fp32 arithmetic and the reference's double round to different bf16 neighbours.
  bool bf16_tokens = false;
  /// nvfp4's random Hadamard transform of the weight-gradient operands along the tokens
  /// (lowp::hadamard_rows), as the stage applies it; false leaves it out (a test's contrast).
  bool hadamard = true;
  /// The last `keep_last` layers run no recipe (stage 06's --fp8-keep-last): their GEMMs
  /// multiply the operands as stored, the weights rounded to bf16 under bf16_tokens (the bf16
  /// GEMMs of the recipe the FP8 one runs inside), in double.
  std::int64_t keep_last = 0;
  /// nvfp4's stochastic rounding of the gradient operands, with the stage's random bits
  /// (lowp::gradient_stream, the element's place in its replica's tensor); false rounds them to
  /// nearest (a test's contrast).
  bool stochastic = true;
};

/// The starting point make_model() generates from c.seed (fp32 values, widened to double).
ReferenceState reference_init(const BlockConfig& c);

/// Initialises the model from c.seed exactly as make_model() does and runs `steps` steps.
ReferenceRun reference_run(const BlockConfig& c, int steps);

/// reference_run() with every linear layer's GEMMs under the low-precision recipe `lowp`.
ReferenceRun reference_run_lowp(const BlockConfig& c, int steps, const LowpEmulation& lowp);

/// Runs `steps` steps from an explicit starting point (tests perturb it for finite differences),
/// the GEMMs in plain double or, given `lowp`, emulating that recipe.
ReferenceRun reference_run_from(const BlockConfig& c, ReferenceState state, int steps,
                                const std::optional<LowpEmulation>& lowp = std::nullopt);

}  // namespace tpx
