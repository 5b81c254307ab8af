// Stage 03, tensor + sequence parallelism: stage 02's column/row-parallel linears, with the
// residual stream (norms, residual adds, loss) split along the sequence instead of replicated.
//
// Outside the tensor-parallel regions every rank holds [S/N, B, H], a contiguous slice of dim 0.
// Only f and g change (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
// Transformer Models"):
//   f (entering the region):  forward all-gather along S,      backward reduce-scatter along S
//   g (leaving the region):   forward reduce-scatter along S,  backward all-gather along S
// An all-reduce is a reduce-scatter followed by an all-gather; stage 02 did both halves in g (or
// f), this stage does one half in g and the other in the next f, and keeps the tokens in between
// split. The norm gains now see only S/N tokens per rank, so their gradients are all-reduced.
//
// defines: tpx::sp::SequenceConjugates, tpx::sp::SequenceParallel,
//          tpx::sp::make_sequence_parallel()
#pragma once

#include <memory>
#include <span>
#include <string>

#include "02_megatron_tp/layers.h"
#include "common/parallel.h"
#include "common/stage.h"
#include "common/tp.h"

namespace tpx::sp {

/// f and g between the sequence-split residual stream [S/N, B, H] and the regions' [S, B, ·].
class SequenceConjugates final : public megatron::Conjugates {
 public:
  explicit SequenceConjugates(TpGroup& group) : group_(group) {}
  Tensor f_forward(const Tensor& h) override;
  Tensor f_regather(const Tensor& h) override;
  Tensor f_backward(const Tensor& dh_partial) override;
  Tensor g_forward(const Tensor& y_partial) override;
  Tensor g_backward(const Tensor& dy) override;

 private:
  TpGroup& group_;
};

/// Stage 03's Parallelism: weights split as in stage 02, activations outside the regions split
/// along S, norm gains replicated with all-reduced gradients. The column-parallel linears keep
/// their local [S/N, B, H] input; backward all-gathers it again (see the chapter).
class SequenceParallel : public megatron::TensorParallel<SequenceConjugates> {
 public:
  using TensorParallel::TensorParallel;
  Sharding sharding() const override;
  void reduce_replicated_grad(const Tensor& grad) override;
  Tensor gather_activation(const Tensor& local) override { return group_.gather_sequence(local); }
};

/// The stage's factory: checks that N divides NH, F and S (ConfigError otherwise), then builds.
std::unique_ptr<Parallelism> make_sequence_parallel(const RunContext& ctx);

}  // namespace tpx::sp
