// The oracle: a deliberately plain double-precision implementation of the stacked block, forward,
// backward and SGD, in loops. It shares no compute code with the stages (only the initialiser, so
// it sees the same numbers); tests and `01_baseline --check` compare against it.
//
// defines: tpx::ReferenceRun, tpx::reference_run()
#pragma once

#include <array>
#include <vector>

#include "config.h"
#include "model.h"

namespace tpx {

struct ReferenceRun {
  // From the first forward + backward, before any update (all unsharded, C order).
  std::vector<double> output;      ///< [S, B, H]
  std::vector<double> input_grad;  ///< [S, B, H]
  std::vector<std::array<std::vector<double>, kNumParams>> grads;  ///< [layer][param]
  /// losses[i]: the loss after i SGD updates.
  std::vector<double> losses;
};

/// Initialises the model from c.seed exactly as make_model() does and runs `steps` steps.
ReferenceRun reference_run(const BlockConfig& c, int steps);

}  // namespace tpx
