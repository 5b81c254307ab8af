// The training loop every stage shares: forward through L blocks, the loss, backward (a block's
// forward or cheap ops made again first under --recompute), SGD or AdamW; plus
// the first-step snapshot that --check and --dump read, and the comparison against a reference.
//
// defines: tpx::StepRow, tpx::Snapshot, tpx::TrainResult, tpx::train(), tpx::CheckRow,
//          tpx::compare(), tpx::to_reference(), and the loop's parts in tpx::training (which
//          stage 09's pipeline executor shares)
#pragma once

#include <array>
#include <cstddef>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint.h"
#include "config.h"
#include "mlp_branch.h"
#include "model.h"
#include "ops.h"
#include "parallel.h"
#include "reference.h"
#include "trace.h"

namespace tpx {

/// One row of the step table.
struct StepRow {
  int step = 0;
  double loss = 0;  ///< loss before this step's update
  /// --eval-every: the loss on the held-out split's batch with the same parameters; NaN on the
  /// steps that do not evaluate.
  double eval_loss = std::numeric_limits<double>::quiet_NaN();
  double grad_norm = 0;  ///< global L2 norm of all gradients
  double ms = 0;         ///< forward + backward + update, wall clock
  CommStats comm;        ///< this rank's communication in the step
  /// The part of `comm` that full recompute's second forwards moved (0 under none/selective).
  CommStats recompute_comm;
  /// Time in the step during which communication ran and compute did not (common/trace.h).
  double exposed_comm_ms = 0;
  std::size_t peak_bytes = 0;
  std::size_t reserved_bytes = 0;  ///< held by the allocator at the step's end (cache included)
  /// --save: the checkpoint written after this step's update (empty: none) and the time the
  /// save held the step loop, outside `ms`: the whole save, or under --async-save (`save_async`)
  /// the host copy and the wait for the previous save, if it was still being written.
  std::string saved;
  double save_ms = 0;
  bool save_async = false;
};

/// Full, unsharded host copies from the first forward + backward (valid on rank 0 only).
struct Snapshot {
  /// --task block: x, T, the last block's output and dL/dx. --task lm: the embedding's output x,
  /// no target, the last block's output, dL/dx.
  std::vector<float> input, target, output, input_grad;
  /// --task lm: the step's token ids and targets [S, B], and the embedding, final gain and output
  /// layer with their gradients (kLmParams order, the vocabulary unpadded).
  std::vector<std::int32_t> tokens, targets;
  std::array<std::vector<float>, kLmParams> lm_params, lm_grads;
  std::vector<std::array<std::vector<float>, kNumParams>> params, grads;  ///< [layer][param]
  double loss = 0;
  std::vector<std::pair<std::string, Tensor>> extra;  ///< Parallelism::dump_extra()
  /// The stage's extra parameters and their gradients (ExtraParameters::snapshot(): stage 10's
  /// experts). A layer whose MLP is such a branch has no dense w_gate, w_up, w_down: their
  /// entries in params and grads are empty.
  NamedValues extra_params, extra_grads;
};

struct TrainResult {
  std::vector<StepRow> rows;  ///< the steps completed (all of them unless `diverged`)
  /// Set when a step's loss or gradient norm was NaN or infinite: one line naming the step. The
  /// values are sums over ranks, identical everywhere, so every rank stops at the same step.
  std::string diverged;
  Snapshot first;  ///< filled when requested
  /// --generate: the parameters after the last update (params and lm_params only), on rank 0.
  Snapshot trained;
  /// This rank, all layers, first step: the activations saved between forward and backward.
  /// Under --recompute, what every layer kept (its input, for a recomputed layer; all but the
  /// cheap ops' outputs, under selective) plus what the largest recompute makes again while
  /// that one block's backward runs.
  std::size_t saved_activation_bytes = 0;
  /// What the stage adds to --json's summary (stage 09: the pipeline's schedule, live counts and
  /// measured idle time), merged at the top level; null for none.
  nlohmann::json extra;
};

/// Runs c.steps steps of the model on this rank, or fewer if training diverges (see
/// TrainResult::diverged). `on_row` sees each row as it completes.
TrainResult train(const BlockConfig& c, Parallelism& par, bool snapshot, Trace& trace,
                  const std::function<void(const StepRow&)>& on_row = {});

/// The parts of the loop that another loop over the same model reuses (stage 09's pipeline).
namespace training {

/// into += more, every counter.
void add(CommStats& into, const CommStats& more);
/// t in dtype d: t itself, or a new tensor holding t's values cast (rounded once) to d.
Tensor as_dtype(const Tensor& t, DType d);
/// t's values as host fp32.
std::vector<float> host_copy(const Tensor& t);
/// The parameters the block computes with, into `out`: under --dtype bf16, a bf16 copy of each
/// weight matrix rounded from its fp32 master weight (the norm gains stay fp32); else the master
/// weights themselves. The copies are made from the masters once, at the first step; after each
/// step the optimizer's update pass writes them (update()), so no step reads the masters again
/// to make them. Call it at the start of every step with the same `out`.
void make_compute_copies(const BlockConfig& c, const Model& m, std::vector<LayerParams>& out);
/// The language model's compute copies, into `out` as make_compute_copies(): the output layer's
/// bf16 copy under --dtype bf16 (and fp8), the rest as m holds them.
void lm_compute_copies(const BlockConfig& c, const Model& m, LmParams& out);
/// A whole language-model tensor's values (as gathered: its vocabulary padded to a multiple of
/// T) without the padding: the embedding's first V rows, the output layer's first V columns.
/// An empty vector (a rank that gathered nothing) stays empty.
std::vector<float> unpadded_vocab(const BlockConfig& c, Split split, std::vector<float> padded);
/// AdamW's two moments per parameter of m (zero); empty under SGD.
struct Moments {
  std::vector<std::array<LayerParams, 2>> layers;
  std::array<std::array<Tensor, kLmParams>, 2> lm;  ///< the language model's (--task lm)
};
Moments make_moments(const BlockConfig& c, const Model& m);
/// Every tensor of the training state this rank holds, in common/checkpoint.h's state_parts()
/// order: m's parameters (layer by layer, then the language model's), then AdamW's first and
/// second moments of them (none under SGD).
std::vector<Tensor*> state_tensors(Model& m, Moments& moments);
/// A training loop's checkpoints (common/checkpoint.h), the same in every loop: made after the
/// model is cut (`sh`: this rank's part, m and moments its tensors), it reads --resume's state
/// (every rank stops, exit 2, when any cannot); after_step() saves when --save and --save-every
/// say so (on a writer thread under --async-save), and finish() waits for the last save.
class Checkpoints {
 public:
  Checkpoints(const BlockConfig& c, const Sharding& sh, Model& m, Moments& moments);
  /// The step the loop starts at: the checkpoint's, or 0.
  int first_step() const;
  /// After row.step's update: saves the state of step row.step + 1 when it is due.
  void after_step(StepRow& row, Trace& trace);
  /// After the last step.
  void finish(TrainResult& result);

 private:
  const BlockConfig& c_;
  Sharding sh_;
  Model& m_;
  Moments& moments_;
  std::optional<AsyncCheckpointWriter> writer_;
};
/// AdamW's scalars at step t (from 1): the decays, eps, the bias-corrected step size and
/// sqrt(1 − β2ᵗ), in double rounded once; decay 1 (the caller sets a decayed tensor's).
ops::AdamWStep adamw_step(const BlockConfig& c, int t);
/// The optimizer step t (from 1) on every parameter m holds. In the same pass over each parameter
/// it writes the parameter's compute copy (make_compute_copies' `copies`, lm_compute_copies'
/// `lm_copies`) where that is a bf16 copy of its own.
void update(const BlockConfig& c, Model& m, Moments& moments, int t,
            const std::vector<LayerParams>& copies, const LmParams& lm_copies);
/// This rank's part of Σ g² over m's gradients: sharded gradients count everywhere, replicated
/// ones (identical on every rank of the TP group) on its rank 0 only.
double grad_square_sum(const Model& m, const Sharding& sh);
/// On rank 0, into s.params and s.lm_params: the whole model from every rank's part of m
/// (collective: every rank calls it; the vocabulary unpadded). With `grads`, s.grads and
/// s.lm_grads from m's gradients as well.
void gather_model(const BlockConfig& c, Parallelism& par, const Model& m, bool grads, Snapshot& s);
/// The global L2 norm of every rank's gradients: grad_square_sum() summed by par.
double grad_norm(Parallelism& par, const Model& m, const Sharding& sh, Trace& trace);
/// The line that stops training at `row` when its loss or gradient norm is not finite (the
/// values are sums over ranks, the same everywhere, so every rank stops at the same step);
/// empty otherwise.
std::string divergence(const StepRow& row, double lr);
/// Ends the step of `row`: the optimizer's update (a phase of its own on the trace), then the
/// row's time (`ms` before the update, plus the update's), its exposed comm and memory.
void finish_step(const BlockConfig& c, Parallelism& par, Model& m, Moments& moments,
                 const std::vector<LayerParams>& copies, const LmParams& lm_copies, Trace& trace,
                 StepRow& row, double ms);

}  // namespace training

/// A run of the plain training loop, seen as a reference (for later stages' --check).
ReferenceRun to_reference(const TrainResult& r);

/// One line of the --check table.
struct CheckRow {
  std::string name;
  double max_abs = 0;
  double max_rel = 0;  ///< max |got − want| / max |want|, the error relative to the tensor's scale
  std::int64_t nonfinite = 0;  ///< NaN or ±Inf values in got or want (any makes the row FAIL)
  double cosine = 1;           ///< got·want / (|got|·|want|) over the finite pairs
  bool ok = false;
};

/// What --check accepts.
struct CheckTolerance {
  double rtol = 1e-5;    ///< max_rel of every tensor and loss
  double cosine = 0;     ///< > 0: gradients pass on cosine ≥ this instead of on rtol (FP8)
  double loss_rtol = 0;  ///< > 0: the losses' own relative tolerance
};

/// Compares the snapshot and the per-step losses against a reference that ran
/// `ref.losses.size()` steps.
std::vector<CheckRow> compare(const Snapshot& got, const std::vector<StepRow>& rows,
                              const ReferenceRun& want, const CheckTolerance& tol);

}  // namespace tpx
