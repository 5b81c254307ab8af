#include "03_sequence_parallel/layers.h"

namespace tpx::sp {

// --- f and g -------------------------------------------------------------------------------------

Tensor SequenceConjugates::f_forward(const Tensor& h) {
  return group_.all_gather(h, "f fwd: all-gather");  // [S/N, B, H] -> [S, B, H]
}

Tensor SequenceConjugates::f_regather(const Tensor& h) {
  return group_.all_gather(h, "f bwd: re-gather");  // the kept [S/N, B, H] shard, for dW
}

Tensor SequenceConjugates::f_backward(const Tensor& dh_partial) {
  return group_.reduce_scatter(dh_partial, "f bwd: reduce-scatter");  // [S, B, H] -> [S/N, B, H]
}

Tensor SequenceConjugates::g_forward(const Tensor& y_partial) {
  return group_.reduce_scatter(y_partial, "g fwd: reduce-scatter");  // [S, B, H] -> [S/N, B, H]
}

Tensor SequenceConjugates::g_backward(const Tensor& dy) {
  return group_.all_gather(dy, "g bwd: all-gather");  // [S/N, B, H] -> [S, B, H]
}

// --- the stage -----------------------------------------------------------------------------------

Sharding SequenceParallel::sharding() const {
  return {.rank = group_.rank(), .world = group_.world(), .weights = true, .sequence = true};
}

void SequenceParallel::reduce_replicated_grad(const Tensor& grad) {
  // Each rank's norm-gain gradient sums over its S/N tokens only; the gain's gradient sums all S.
  group_.all_reduce(grad, "norm-gain grad: all-reduce");
}

std::unique_ptr<Parallelism> make_sequence_parallel(const RunContext& ctx) {
  check_tp_split(ctx.options.config, ctx.world, /*sequence=*/true);
  return std::make_unique<SequenceParallel>(ctx);
}

}  // namespace tpx::sp
