// Stage 02, Megatron tensor parallelism: the block's linear layers split across N ranks.
//
//   ColumnParallelLinear (Wq, Wk, Wv, Wg, Wu): rank r holds columns [r·out/N, (r+1)·out/N) of W,
//     whole heads for Wq/Wk/Wv, so attention and SwiGLU run on local columns with no traffic.
//   RowParallelLinear (Wo, Wd): rank r holds the matching rows of W and produces a partial sum.
//
// Two conjugate operators join them to the replicated residual stream:
//   f (entering the region):  forward identity,    backward all-reduce
//   g (leaving the region):   forward all-reduce,  backward identity
// Conjugates is an interface so that a later stage can keep these linears and change only f and g.
//
// defines: tpx::megatron::Conjugates, tpx::megatron::AllReduceConjugates,
//          tpx::megatron::ColumnParallelLinear, tpx::megatron::RowParallelLinear,
//          tpx::megatron::TensorParallel, tpx::megatron::MegatronParallel,
//          tpx::megatron::make_megatron()
#pragma once

#include <memory>
#include <span>
#include <string>

#include "common/parallel.h"
#include "common/stage.h"
#include "common/tp.h"

namespace tpx::megatron {

/// The pair of operators around a tensor-parallel region: f before a column-parallel group,
/// g after a row-parallel layer. Each one's backward is the other one's forward.
class Conjugates {
 public:
  virtual ~Conjugates() = default;
  /// The column group's input as its GEMMs see it, from the residual-stream layout.
  virtual Tensor f_forward(const Tensor& h) = 0;
  /// f(h) again in backward, from the input the column group kept: the weight gradient needs it.
  virtual Tensor f_regather(const Tensor& h) { return f_forward(h); }
  /// The residual-stream gradient from this rank's partial input gradient [S, B, H].
  virtual Tensor f_backward(const Tensor& dh_partial) = 0;
  /// The residual-stream output from this rank's partial sum [S, B, H].
  virtual Tensor g_forward(const Tensor& y_partial) = 0;
  /// The row layer's output gradient as its GEMMs need it, from the residual-stream gradient.
  virtual Tensor g_backward(const Tensor& dy) = 0;
};

/// Megatron's f and g: every rank holds the whole [S, B, H] residual stream.
class AllReduceConjugates final : public Conjugates {
 public:
  explicit AllReduceConjugates(TpGroup& group) : group_(group) {}
  Tensor f_forward(const Tensor& h) override { return h; }
  Tensor f_backward(const Tensor& dh_partial) override;
  Tensor g_forward(const Tensor& y_partial) override;
  Tensor g_backward(const Tensor& dy) override { return dy; }

 private:
  TpGroup& group_;
};

/// y[i] = f(h) · W[i] for a group sharing its input h, each W[i] this rank's [in, out/N] columns.
/// `compute` is the GEMM operand type (--dtype): fp32, or bf16 with fp32 accumulation.
class ColumnParallelLinear {
 public:
  ColumnParallelLinear(Conjugates& fg, DType compute, Trace& trace)
      : fg_(fg), compute_(compute), trace_(trace) {}
  /// Keeps h as given (before f) for backward.
  ColumnResult forward(const Tensor& h, std::span<const Tensor> w, std::string_view role);
  /// Applies f to the kept h again (free here; a communicating f repeats its traffic instead of
  /// keeping its larger output), writes dW[i] = f(h)ᵀ·dy[i], returns f_backward(Σ dy[i]·W[i]ᵀ).
  Tensor backward(const Tensor& h, std::span<const Tensor> w, std::span<const Tensor> dy,
                  std::span<const Tensor> dw, std::string_view role);

 private:
  Conjugates& fg_;
  DType compute_;
  Trace& trace_;  // each GEMM is a span on the compute lane
};

/// y = g(a · W) with W this rank's [in/N, out] rows and a the matching [.., in/N] columns.
class RowParallelLinear {
 public:
  RowParallelLinear(Conjugates& fg, DType compute, Trace& trace)
      : fg_(fg), compute_(compute), trace_(trace) {}
  Tensor forward(const Tensor& a, const Tensor& w, std::string_view role);
  /// Writes dW = aᵀ·g_backward(dy), returns da = g_backward(dy)·Wᵀ.
  Tensor backward(const Tensor& a, const Tensor& w, const Tensor& dy, const Tensor& dw,
                  std::string_view role);

 private:
  Conjugates& fg_;
  DType compute_;
  Trace& trace_;  // each GEMM is a span on the compute lane
};

/// A tensor-parallel Parallelism: column- and row-parallel linears joined by the conjugates FG.
/// Stage 02 instantiates it with AllReduceConjugates; stage 03 with its sequence-parallel pair.
template <class FG>
class TensorParallel : public Parallelism {
 public:
  explicit TensorParallel(const RunContext& ctx)
      : group_(ctx),
        fg_(group_),
        column_(fg_, ctx.options.config.dtype, ctx.trace),
        row_(fg_, ctx.options.config.dtype, ctx.trace) {}

  std::string comm_name() const override { return group_.name(); }
  ColumnResult column_forward(const Tensor& h, std::span<const Tensor> w,
                              std::string_view role) override {
    return column_.forward(h, w, role);
  }
  Tensor column_backward(const Tensor& saved, std::span<const Tensor> w, std::span<const Tensor> dy,
                         std::span<const Tensor> dw, std::string_view role) override {
    return column_.backward(saved, w, dy, dw, role);
  }
  Tensor row_forward(const Tensor& a, const Tensor& w, std::string_view role) override {
    return row_.forward(a, w, role);
  }
  Tensor row_backward(const Tensor& a, const Tensor& w, const Tensor& dy, const Tensor& dw,
                      std::string_view role) override {
    return row_.backward(a, w, dy, dw, role);
  }
  Tensor vocab_reduce(const Tensor& partial) override { return fg_.g_forward(partial); }
  Tensor vocab_reduce_backward(const Tensor& dx) override { return fg_.g_backward(dx); }
  void vocab_all_reduce(const Tensor& t, VocabReduce op) override {
    if (op == VocabReduce::max)
      group_.all_reduce_max(t, "cross-entropy: max all-reduce");
    else
      group_.all_reduce(t, "cross-entropy: sum all-reduce");
  }
  double sum_over_ranks(double local) override { return group_.sum_for_report(local); }
  Tensor gather_param(Param p, const Tensor& local) override {
    return group_.gather_param(p, local);
  }
  Tensor gather_vocab(Split split, const Tensor& local) override {
    return group_.gather_split(split, local);
  }
  CommStats take_comm_stats() override { return group_.take_stats(); }
  void synchronize() override { group_.synchronize(); }

 protected:
  TpGroup group_;
  FG fg_;
  ColumnParallelLinear column_;
  RowParallelLinear row_;
};

/// Stage 02's Parallelism: weights split by param_split(), activations and norm gains replicated
/// (so gather_activation keeps the default: rank 0 holds them whole).
class MegatronParallel final : public TensorParallel<AllReduceConjugates> {
 public:
  using TensorParallel::TensorParallel;
  Sharding sharding() const override;
};

/// The stage's factory: checks that N divides NH and F (ConfigError otherwise), then builds.
std::unique_ptr<Parallelism> make_megatron(const RunContext& ctx);

}  // namespace tpx::megatron
