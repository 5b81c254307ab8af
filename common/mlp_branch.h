// What a stage may train beside the model's own parameters (common/model.h): layers whose MLP is
// not the block's SwiGLU but a branch of the stage's (stage 10's mixture of experts), with
// parameters, gradients, optimizer state and losses of their own. The shared block calls the
// branch where it would run the SwiGLU; the shared training loop asks the stage's Parallelism
// for them (Parallelism::extra_parameters()) and counts their losses, gradient norm, update and
// snapshot with the rest.
//
// defines: tpx::MlpBranch, tpx::NamedValues, tpx::ExtraParameters
#pragma once

#include <cstddef>
#include <vector>

#include <nlohmann/json.hpp>

#include "named.h"
#include "tensor.h"
#include "trace.h"

namespace tpx {

/// An MLP in place of a layer's SwiGLU: from norm2's output h2 to what the residual adds.
class MlpBranch {
 public:
  virtual ~MlpBranch() = default;
  /// h2 (this rank's tokens, [rows, B_local, H]) → the branch's output of the same shape; keeps
  /// what backward needs (collective over the stage's groups).
  virtual Tensor forward(const Tensor& h2, Trace& trace) = 0;
  /// ∂loss/∂output → ∂loss/∂h2. Afterwards the branch's parameter gradients (its own losses'
  /// included) are complete on this rank.
  virtual Tensor backward(const Tensor& dout, Trace& trace) = 0;
  /// Bytes of what forward keeps for backward.
  virtual std::size_t saved_bytes() const = 0;
};

/// Whole tensors by name, as --check and --dump take them.
using NamedValues = std::vector<NamedArray<float>>;

/// The parameters of a stage's MLP branches and what the loop does with them.
class ExtraParameters {
 public:
  virtual ~ExtraParameters() = default;
  /// Layer l's branch (l: the rank's index of the layer, as Model's), or null where the layer
  /// keeps the SwiGLU.
  virtual MlpBranch* mlp(std::size_t layer) = 0;
  /// A pipeline's micro-batches (stage 09's executor): the branches' calls that follow are
  /// micro-batch j's of the step's m, whose forwards may all run before the first backward. Each
  /// branch keeps one saved state per micro-batch, and its gradients and losses are the sums
  /// over the m. Without a call: one micro-batch, the step.
  virtual void microbatch(int /*j*/, int /*m*/) {}
  /// This rank's part of the losses the branches added in the last forward (the auxiliary
  /// losses): the parts sum to them over all ranks.
  virtual double loss_part() const = 0;
  /// This rank's part of Σ g² over the branches' gradients: each value counted on one rank.
  virtual double grad_square_sum() const = 0;
  /// After a step's backward: the optimizer's step t (from 1) on the branches' parameters, and
  /// whatever else a step moves that is not a gradient.
  virtual void update(int t) = 0;
  /// On rank 0 (collective): every parameter and its gradient whole, under one name each.
  virtual void snapshot(NamedValues& params, NamedValues& grads) = 0;
  /// What --json's summary adds, at its top level (null: nothing).
  virtual nlohmann::json summary() const { return nullptr; }
  /// The summaries of a pipeline's stages, each over the layers it holds, in stage order, as one
  /// summary of the whole model (the first, unless the stage joins them).
  virtual nlohmann::json joined(const std::vector<nlohmann::json>& parts) const {
    return parts.empty() ? nlohmann::json() : parts.front();
  }
};

}  // namespace tpx
