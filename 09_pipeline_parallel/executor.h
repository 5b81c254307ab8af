// Stage 09's executor: one rank's list of schedule actions run in order for one step. Each
// forward (F) runs the micro-batch through the virtual stage's layers, each backward (B) back
// through them (zb-h1: with the dW GEMMs set aside), each W runs what its B set aside; receives
// are posted one action ahead and each result is sent (or left on this rank, for its next
// virtual stage) as soon as the action that made it ends. The gradients of every layer
// accumulate over the M micro-batches and go to the slice's reduction after the last one.
//
// defines: tpx::pp::Executor
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "09_pipeline_parallel/pipeline.h"
#include "09_pipeline_parallel/schedule.h"
#include "common/block.h"
#include "common/lm.h"
#include "common/model.h"

namespace tpx::pp {

/// What one (micro-batch, virtual stage) pair holds between its actions.
struct Pass {
  Tensor x;                            ///< the stage's input
  std::vector<BlockActivations> acts;  ///< per layer of the stage
  Tensor y;                            ///< the stage's output (forward)
  Tensor dy;                           ///< the gradient of y (backward's input)
  Tensor dx;                           ///< the gradient of x (backward's output)
  std::vector<LayerParams> grads;      ///< zb-h1: the gradients W completes, per layer
  WeightGradWork work;                 ///< zb-h1: the dW GEMMs B set aside
};

/// A rank's sends (or receives) grouped by the action that makes (or reads) them: one list, and
/// where each action's part begins (a map from action to list would cost a node per action).
class ByAction {
 public:
  ByAction() = default;
  /// `xs` in any order; `actions` the length of the rank's action list.
  ByAction(std::vector<pipeline::Transfer> xs, std::size_t actions)
      : xs_(std::move(xs)), first_(actions + 1) {
    std::ranges::stable_sort(xs_, {}, &pipeline::Transfer::action);
    std::size_t k = 0;
    for (std::size_t i = 0; i <= actions; ++i) {
      first_[i] = k;
      while (k < xs_.size() && xs_[k].action == i) ++k;
    }
    TPX_CHECK(k == xs_.size(), "a transfer of an action past the schedule's end");
  }
  std::span<const pipeline::Transfer> at(std::size_t i) const {
    return std::span(xs_).subspan(first_[i], first_[i + 1] - first_[i]);
  }

 private:
  std::vector<pipeline::Transfer> xs_;
  std::vector<std::size_t> first_;
};

/// One step's actions on this rank, and what they leave behind.
class Executor {
 public:
  Executor(const BlockConfig& c, PipelineParallel& pp, Model& model, Trace& trace);

  /// --task block: the micro-batches of the block's input (stage 0) and of the target (the
  /// last stage).
  std::vector<Tensor> inputs, targets;
  /// --task lm: the step's token ids and targets, per micro-batch, and the language model's
  /// compute copies (the embedding on stage 0's rank, the final norm and output layer on the last
  /// stage's).
  std::vector<lm::RankTokens> tokens;
  LmParams lm_params;
  /// [S/(C·T), B/(D·M), H]: every message between stages.
  Tensor::Shape message_shape;

  struct Result {
    double loss_sum = 0;         ///< this rank's part of Σ (y − T)² (last stage)
    double busy_ms = 0;          ///< the actions' own time
    int peak_live = 0;           ///< the most (micro-batch, stage) activations alive at once
    std::size_t peak_saved = 0;  ///< the most bytes of saved activations alive at once
    /// The slice's traffic taken out around --recompute full's forwards: what the step moved
    /// before each, and what each moved (the rest is still in the slice's stats at the end).
    CommStats comm, recompute_comm;
    std::vector<Tensor> x, y, dx;  ///< per micro-batch: stage 0's input (--task lm: the
                                   ///< embedding's output), the last stage's output, stage 0's dx
  };

  /// One step: this rank's actions in the schedule's order with the step's compute copies
  /// `params`; `keep` keeps the last stage's outputs and stage 0's input gradients (snapshot).
  Result run(const std::vector<LayerParams>& params, bool keep);

  /// --eval-every: this rank's part of the loss summed over `batch`'s micro-batches (the
  /// held-out tokens, cut as the step's), forward only with `params` and lm_params. A plain
  /// sweep, not the schedule: micro-batch by micro-batch, each of this rank's virtual stages in
  /// order, receiving its input, running its layers and sending its output on; nothing is kept
  /// for a backward. Every rank of the pipeline calls it after run() has drained every message of
  /// the step, so its messages, the only ones then on the activation lanes, arrive in the order
  /// sent.
  double evaluate(const std::vector<LayerParams>& params, const std::vector<lm::RankTokens>& batch);

 private:
  static std::string name(const pipeline::Transfer& x);
  void post_receives(std::size_t i);
  /// What action i made for the next (forward) or previous (backward) virtual stage: sent, or
  /// left here when this rank holds that stage too.
  void pass_on(std::size_t i, std::optional<Event> (&sent)[2]);
  Tensor incoming(std::size_t i, pipeline::Payload payload);
  void forward(std::size_t i, const std::vector<LayerParams>& params, Result& r, bool keep);
  void backward(std::size_t i, const std::vector<LayerParams>& params, Result& r, bool keep);
  void weights(const pipeline::Action& a);
  /// --recompute: what global layer `layer` keeps between its forward and its backward (its
  /// input under full recompute, all but the cheap ops' outputs under selective), and making
  /// again what it let go, before its backward.
  void release(std::int64_t layer, BlockActivations& saved) const;
  /// Local layer l's MLP branch (stage 10's experts) set to `microbatch`'s state, or null.
  MlpBranch* branch(std::size_t l, int microbatch);
  void remake(std::int64_t layer, const LayerParams& w, BlockActivations& saved, Result& r);
  LayerParams fresh_grads(std::size_t l);
  LayerParams& accumulator(std::size_t l);
  void accumulate(std::size_t l, const LayerParams& g);
  /// --task lm: adds one micro-batch's gradients of the language model's tensors defined in `g`
  /// into the step's (lm_acc_).
  void accumulate_lm(const LmParams& g);
  /// Buffers for one micro-batch's language-model gradients, the shapes of the step's.
  LmParams lm_scratch();

  const BlockConfig& c_;
  PipelineParallel& pp_;
  Parallelism& slice_;
  Model& m_;
  Trace& trace_;
  pipeline::PipelineShape shape_;
  int me_;
  const std::vector<pipeline::Action>& actions_;
  bool split_;
  std::map<std::int64_t, std::size_t> local_;  // global layer → index in m_
  ByAction sends_, receives_;
  std::map<std::pair<int, int>, Pass> passes_;       // (micro-batch, stage)
  std::map<int, std::pair<Tensor, Event>> buffers_;  // posted receives, by tag
  std::map<std::tuple<int, int, pipeline::Payload>, Tensor>
      local_messages_;                      // (micro-batch, to stage)
  std::map<std::size_t, LayerParams> acc_;  // by local layer
  std::map<std::size_t, int> done_;         // micro-batches accumulated
  /// What every live pass keeps for its backward now: added by each layer's forward, taken
  /// away by its backward, so that the peak costs O(1) per action.
  std::size_t saved_ = 0;
  LayerParams scratch_;  // one micro-batch's gradients of a layer, reused (no split)
  LmParams lm_scratch_;  // one micro-batch's language-model gradients, reused
  LmParams lm_acc_;      // the step's, the slice's buffers (Parallelism::lm_grads)
};

}  // namespace tpx::pp
