// The oracle: a deliberately plain double-precision implementation of the stacked block, forward,
// backward and SGD, in loops. It shares no compute code with the stages (only the initialiser, so
// it sees the same numbers); tests and `01_baseline --check` compare against it.
//
// defines: tpx::ReferenceRun, tpx::ReferenceState, tpx::reference_init(), tpx::reference_run(),
//          tpx::reference_run_from()
#pragma once

#include <array>
#include <vector>

#include "config.h"
#include "model.h"

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
};

/// A starting point of the reference: input, target and every layer's parameters (unsharded).
struct ReferenceState {
  std::vector<double> input, target;              // [S, B, H] (--task block)
  std::array<std::vector<double>, kLmParams> lm;  ///< --task lm: E [V, H], norm_f [H], W_out [H, V]
  std::vector<std::array<std::vector<double>, kNumParams>> params;  ///< [layer][param]
};

/// The starting point make_model() generates from c.seed (fp32 values, widened to double).
ReferenceState reference_init(const BlockConfig& c);

/// Initialises the model from c.seed exactly as make_model() does and runs `steps` steps.
ReferenceRun reference_run(const BlockConfig& c, int steps);

/// Runs `steps` steps from an explicit starting point (tests perturb it for finite differences).
ReferenceRun reference_run_from(const BlockConfig& c, ReferenceState state, int steps);

}  // namespace tpx
