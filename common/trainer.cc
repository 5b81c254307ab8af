#include "trainer.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "agree.h"
#include "block.h"
#include "check.h"
#include "checkpoint.h"
#include "data.h"
#include "lm.h"
#include "ops.h"

namespace tpx {
namespace training {

void add(CommStats& into, const CommStats& more) {
  into += more;
}

Tensor as_dtype(const Tensor& t, DType d) {
  if (t.dtype() == d) return t;
  Tensor out = Tensor::empty(t.shape(), d, t.device());
  ops::cast(t, out);
  return out;
}

std::vector<float> host_copy(const Tensor& t) {
  const Tensor h = as_dtype(ops::to_device(t, Device::cpu), DType::f32);
  return {h.f32().begin(), h.f32().end()};
}

namespace {

/// Whether `t` is a compute copy of its own (bf16), which the optimizer's update writes, rather
/// than the fp32 master itself.
bool own_copy(const Tensor& t) {
  return t.defined() && t.dtype() == DType::bf16;
}

}  // namespace

void make_compute_copies(const BlockConfig& c, const Model& m, std::vector<LayerParams>& out) {
  if (!c.bf16_weight_copies()) {
    out = m.params;
    return;
  }
  // Made once: from then on the update pass keeps them equal to bf16(master).
  if (out.size() == m.params.size() && !out.empty() && own_copy(out.front()[Param::wq])) return;
  out = m.params;
  for (LayerParams& layer : out)
    for (Param p : kAllParams)
      if (param_split(p) != Split::replicated) layer[p] = as_dtype(layer[p], DType::bf16);
}

void lm_compute_copies(const BlockConfig& c, const Model& m, LmParams& out) {
  // The output layer's GEMM reads a bf16 copy under the recipe (and under FP8's, which keeps this
  // layer in bf16), made once as the blocks' are; the lookup reads the fp32 master rows and
  // rounds what it writes.
  const bool copy = c.activations() == DType::bf16 && m.lm.w_out.defined();
  const Tensor w_out = copy && own_copy(out.w_out) ? out.w_out : Tensor();
  out = m.lm;
  if (copy) out.w_out = w_out.defined() ? w_out : as_dtype(m.lm.w_out, DType::bf16);
}

std::vector<float> unpadded_vocab(const BlockConfig& c, Split split, std::vector<float> padded) {
  if (padded.empty() || split == Split::replicated) return padded;
  if (split == Split::rows) {
    padded.resize(static_cast<std::size_t>(c.vocab * c.hidden));
    return padded;
  }
  const auto width = static_cast<std::int64_t>(padded.size()) / c.hidden;
  std::vector<float> out(static_cast<std::size_t>(c.hidden * c.vocab));
  for (std::int64_t i = 0; i < c.hidden; ++i)
    std::copy_n(padded.begin() + i * width, c.vocab, out.begin() + i * c.vocab);
  return out;
}

Moments make_moments(const BlockConfig& c, const Model& m) {
  Moments moments;
  if (c.optimizer != Optimizer::adamw) return moments;
  for (const LayerParams& layer : m.params) {
    auto& mv = moments.layers.emplace_back();
    for (LayerParams& state : mv)
      for (Param p : kAllParams) state[p] = ops::zeros_like(layer[p]);
  }
  for (int i = 0; i < kLmParams; ++i)
    if (const Tensor& t = *m.lm.all()[std::size_t(i)]; t.defined())
      for (auto& state : moments.lm) state[std::size_t(i)] = ops::zeros_like(t);
  return moments;
}

ops::AdamWStep adamw_step(const BlockConfig& c, int t) {
  const double bias1 = 1.0 - std::pow(c.beta1, t), bias2 = 1.0 - std::pow(c.beta2, t);
  return {static_cast<float>(c.beta1),      static_cast<float>(c.beta2),
          static_cast<float>(c.eps),        1.0f,
          static_cast<float>(c.lr / bias1), static_cast<float>(std::sqrt(bias2))};
}

void update(const BlockConfig& c, Model& m, Moments& moments, int t,
            const std::vector<LayerParams>& copies, const LmParams& lm_copies) {
  const auto lm = m.lm.all(), lm_grads = m.lm_grads.all(), lm_copy = lm_copies.all();
  // The bf16 compute copy of a parameter, written in the update's pass, where there is one.
  auto copy_of = [&](std::size_t l, Param p) {
    return l < copies.size() && own_copy(copies[l][p]) ? copies[l][p] : Tensor();
  };
  auto lm_copy_of = [&](std::size_t i) { return own_copy(*lm_copy[i]) ? *lm_copy[i] : Tensor(); };
  if (c.optimizer == Optimizer::sgd) {
    for (std::size_t l = 0; l < m.params.size(); ++l)
      for (Param p : kAllParams)
        ops::sgd_update(m.params[l][p], m.grads[l][p], static_cast<float>(c.lr), copy_of(l, p));
    for (std::size_t i = 0; i < lm.size(); ++i)
      if (lm[i]->defined())
        ops::sgd_update(*lm[i], *lm_grads[i], static_cast<float>(c.lr), lm_copy_of(i));
    return;
  }
  // AdamW's scalars in double, rounded once: the bias corrections of step t, and the decoupled
  // decay, which the norm gains do not get (Megatron-LM's rule).
  ops::AdamWStep s = adamw_step(c, t);
  for (std::size_t l = 0; l < m.params.size(); ++l)
    for (Param p : kAllParams) {
      s.decay = param_split(p) == Split::replicated
                    ? 1.0f
                    : static_cast<float>(1.0 - c.lr * c.weight_decay);
      ops::adamw_update(m.params[l][p], m.grads[l][p], moments.layers[l][0][p],
                        moments.layers[l][1][p], s, copy_of(l, p));
    }
  // The embedding and the output layer decay like the blocks' matrices; the final gain does not.
  for (std::size_t i = 0; i < lm.size(); ++i) {
    if (!lm[i]->defined()) continue;
    s.decay =
        kLmSplits[i] == Split::replicated ? 1.0f : static_cast<float>(1.0 - c.lr * c.weight_decay);
    ops::adamw_update(*lm[i], *lm_grads[i], moments.lm[0][i], moments.lm[1][i], s, lm_copy_of(i));
  }
}

double grad_square_sum(const Model& m, const Sharding& sh) {
  std::vector<Tensor> counted;
  for (const auto& g : m.grads)
    for (Param p : kAllParams)
      if ((sh.weights && param_split(p) != Split::replicated) || sh.rank == 0)
        counted.push_back(g[p]);
  // The language model's as the blocks' (the vocabulary shards everywhere, the final gain on
  // the TP group's rank 0; FSDP's shards of them each on the rank that holds it).
  const auto lm = m.lm_grads.all();
  for (std::size_t i = 0; i < lm.size(); ++i)
    if (lm[i]->defined() && ((sh.weights && kLmSplits[i] != Split::replicated) || sh.rank == 0))
      counted.push_back(*lm[i]);
  // Every tensor's Σ g² read back together (one wait for the device), added in this order.
  double sq = 0.0;
  for (const double x : ops::sum_squares_each(counted)) sq += x;
  return sq;
}

void gather_model(const BlockConfig& c, Parallelism& par, const Model& m, bool grads, Snapshot& s) {
  s.params.resize(static_cast<std::size_t>(c.layers));
  if (grads) s.grads.resize(static_cast<std::size_t>(c.layers));
  for (std::size_t l = 0; l < s.params.size(); ++l)
    for (Param p : kAllParams) {
      const auto i = static_cast<std::size_t>(p);
      s.params[l][i] = host_copy(par.gather_param(p, m.params[l][p]));
      if (grads) s.grads[l][i] = host_copy(par.gather_param(p, m.grads[l][p]));
    }
  if (!c.lm()) return;
  const auto params = m.lm.all(), lm_grads = m.lm_grads.all();
  for (std::size_t i = 0; i < params.size(); ++i) {
    s.lm_params[i] =
        unpadded_vocab(c, kLmSplits[i], host_copy(par.gather_vocab(kLmSplits[i], *params[i])));
    if (grads)
      s.lm_grads[i] =
          unpadded_vocab(c, kLmSplits[i], host_copy(par.gather_vocab(kLmSplits[i], *lm_grads[i])));
  }
}

double grad_norm(Parallelism& par, const Model& m, const Sharding& sh, Trace& trace) {
  // Sharded gradients are summed over ranks; replicated ones (identical on every rank) are
  // counted once, on rank 0.
  double sq = 0.0;
  {
    TraceScope op(trace, "grad norm");
    sq = grad_square_sum(m, sh);
    if (const ExtraParameters* extra = par.extra_parameters()) sq += extra->grad_square_sum();
  }
  return std::sqrt(par.sum_over_ranks(sq));
}

std::string divergence(const StepRow& row, double lr) {
  if (std::isfinite(row.loss) && std::isfinite(row.grad_norm)) return {};
  return fmt::format("{} is not finite at step {} (lr {:g} too large?)",
                     std::isfinite(row.loss) ? "the gradient norm" : "loss", row.step, lr);
}

void finish_step(const BlockConfig& c, Parallelism& par, Model& m, Moments& moments,
                 const std::vector<LayerParams>& copies, const LmParams& lm_copies, Trace& trace,
                 StepRow& row, double ms) {
  const auto t1 = std::chrono::steady_clock::now();
  {
    TraceScope phase(trace, "update", Lane::phase);
    TraceScope scope(trace, std::string(optimizer_flag(c.optimizer)));
    update(c, m, moments, row.step + 1, copies, lm_copies);
    if (ExtraParameters* extra = par.extra_parameters()) extra->update(row.step + 1);
    par.synchronize();
    ops::synchronize(c.device);
  }
  const auto t2 = std::chrono::steady_clock::now();
  row.ms = ms + std::chrono::duration<double, std::milli>(t2 - t1).count();
  row.exposed_comm_ms += trace.exposed_comm_ms(t1, t2);
  const MemoryStats mem = allocator_for(c.device).stats();
  row.peak_bytes = mem.peak;
  row.reserved_bytes = mem.reserved;
}

}  // namespace training

namespace {

using namespace training;

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void take_snapshot(const BlockConfig& c, Parallelism& par, const Model& m, const Tensor& x,
                   const Tensor& y, const Tensor& dx, const TokenBatch& batch, double loss,
                   Snapshot& s) {
  s.loss = loss;
  s.input = host_copy(par.gather_activation(x));
  if (m.target.defined()) s.target = host_copy(par.gather_activation(m.target));
  s.output = host_copy(par.gather_activation(y));
  s.input_grad = host_copy(par.gather_activation(dx));
  gather_model(c, par, m, /*grads=*/true, s);
  if (c.lm()) {
    s.tokens = batch.tokens;
    s.targets = batch.targets;
  }
  s.extra = par.dump_extra();
  if (ExtraParameters* extra = par.extra_parameters()) {
    extra->snapshot(s.extra_params, s.extra_grads);
    // A layer whose MLP is the stage's branch has no dense SwiGLU to report.
    for (std::size_t l = 0; l < s.params.size(); ++l)
      if (extra->mlp(l))
        for (Param p : {Param::w_gate, Param::w_up, Param::w_down}) {
          s.params[l][std::size_t(p)].clear();
          s.grads[l][std::size_t(p)].clear();
        }
  }
}

}  // namespace

TrainResult train(const BlockConfig& c, Parallelism& par, bool snapshot, Trace& trace,
                  const std::function<void(const StepRow&)>& on_row) {
  const Sharding sh = par.sharding();
  Model m = make_model(c, sh);
  par.shard_model(m);
  // --task block: the blocks' input in the activations' dtype (rounded to bf16 once under the
  // recipe). --task lm: the token stream, and the positions this rank looks up and scores.
  const Tensor input = c.lm() ? Tensor() : as_dtype(m.input, c.activations());
  const std::optional<TokenStream> stream =
      c.lm() ? std::optional<TokenStream>(std::in_place, c) : std::nullopt;
  const TokenCut cut = c.lm() ? par.token_cut(c) : TokenCut{};
  // The parameters the blocks compute with (the compute copies, remade every step).
  std::vector<LayerParams> params;
  LmParams lm_params;
  const double count = double(c.seq) * double(c.batch) * double(c.hidden);
  const double positions = double(c.seq) * double(c.batch);
  std::vector<BlockActivations> acts(static_cast<std::size_t>(c.layers));
  // Stage 10's experts: the layers whose MLP is the stage's branch (null: the SwiGLU).
  ExtraParameters* const extra = par.extra_parameters();
  auto mlp = [&](std::size_t l) { return extra ? extra->mlp(l) : nullptr; };
  // What layer l keeps between its forward and its backward (--recompute), and what it makes
  // again before its backward: the block's forward (full) or its cheap ops (selective).
  auto release = [&](std::size_t l) {
    if (c.recomputes_layer(std::int64_t(l)))
      acts[l].keep_only_input();
    else if (c.recompute == Recompute::selective)
      acts[l].drop_cheap();
  };
  auto recompute = [&](std::size_t l, const LayerParams& w) {
    if (c.recomputes_layer(std::int64_t(l))) {
      // The block's forward again from its saved input, collectives included; its output is
      // the next block's input, which is already saved.
      TraceScope again(trace, "recompute", Lane::phase);
      block_forward(c, w, acts[l].x, par, acts[l], trace, mlp(l));
    } else if (c.recompute == Recompute::selective) {
      block_refill(w, par, acts[l], trace);
    }
  };
  auto forward_blocks = [&](Tensor y) {
    for (std::size_t l = 0; l < acts.size(); ++l) {
      const int next = l + 1 < acts.size() ? int(l + 1) : -1;
      const LayerParams w = par.layer_params(params, l, next);
      y = block_forward(c, w, y, par, acts[l], trace, mlp(l));
      release(l);
      par.release_layer(l);
    }
    return y;
  };
  // --eval-every: the model's loss on the held-out split's batch of this step, forward only,
  // with the parameters the step trained with (before its update); its traffic is not the step's.
  auto held_out_loss = [&](int step) {
    TraceScope scope(trace, "held-out loss", Lane::phase);
    par.take_comm_stats();
    const lm::RankTokens valid =
        lm::cut_tokens(stream->batch(step, DataSplit::valid), cut, c.device);
    const Tensor y = forward_blocks(lm::embed(
        c, par, par.lm_params(lm::embedding_end(lm_params)).embedding, valid.tokens, trace));
    lm::HeadActivations head;
    const double mine = lm::head_forward(c, par, par.lm_params(lm::head_end(lm_params)), y,
                                         valid.targets, head, trace);
    for (auto& a : acts) a = {};
    const double loss = par.sum_over_ranks(mine) / positions;
    par.synchronize();
    par.take_comm_stats();
    return loss;
  };
  // AdamW's two moments per parameter, zero before the first step (none under SGD).
  Moments moments = make_moments(c, m);
  Checkpoints checkpoints(c, sh, m, moments);  // --resume's state read; --save's writer
  const int first = checkpoints.first_step();
  TrainResult result;
  par.synchronize();
  ops::synchronize(c.device);  // initialisation's device work is not a step's
  par.take_comm_stats();       // set-up traffic is not a step's

  for (int step = first; step < c.steps; ++step) {
    const auto t0 = Clock::now();
    StepRow row;
    row.step = step;
    TokenBatch batch;
    lm::RankTokens tokens;
    if (stream) {
      batch = stream->batch(step);
      tokens = lm::cut_tokens(batch, cut, c.device);
    }
    Tensor y = input;
    lm::HeadActivations head;
    Tensor first_input;  // the first block's input (the embedding's output under --task lm)
    {
      TraceScope scope(trace, "forward", Lane::phase);
      {
        std::optional<TraceScope> op;  // a span only where there is work to show
        if (c.bf16_weight_copies()) op.emplace(trace, "bf16 weight copies");
        make_compute_copies(c, m, params);
        lm_compute_copies(c, m, lm_params);
      }
      // The embedding's table as the lookup reads it (FSDP: gathered, and let go after it).
      if (c.lm())
        y = lm::embed(c, par, par.lm_params(lm::embedding_end(lm_params)).embedding, tokens.tokens,
                      trace);
      first_input = y;
      y = forward_blocks(y);
    }
    // What backward keeps from forward: what every layer kept, plus what the largest recompute
    // makes again while that one block's backward runs.
    std::size_t saved = 0, one_block = 0;
    for (const auto& a : acts) saved += a.bytes();
    for (std::size_t l = 0; l < acts.size(); ++l)
      if (const MlpBranch* branch = mlp(l)) saved += branch->saved_bytes();
    Tensor dy;
    if (c.lm()) {
      TraceScope scope(trace, "loss", Lane::phase);
      // The head's parameters and gradients as it computes them (FSDP: gathered, unsharded),
      // its gradients' reduction on its way while the blocks' backward runs.
      const LmParams w = par.lm_params(lm::head_end(lm_params));
      const LmParams g = par.lm_grads(lm::head_end(m.lm_grads));
      const double mine = lm::head_forward(c, par, w, y, tokens.targets, head, trace);
      dy = lm::head_backward(c, par, w, head, tokens.targets, 1.0 / positions, g, trace);
      head = {};  // the logits are not kept through the blocks' backward
      par.reduce_lm_grads(g, m.lm_grads);
      row.loss = par.sum_over_ranks(mine) / positions;
    } else {
      TraceScope scope(trace, "loss", Lane::phase);
      dy = Tensor::empty(y.shape(), y.dtype(), y.device());
      // Every token's error counted once: each rank's sequence shard, or a replicated output on
      // rank 0 only (the same rule as the gradient norm below).
      double mine = 0.0;
      {
        TraceScope op(trace, "mse loss");
        if (sh.sequence || sh.rank == 0) mine = ops::mse_loss_sum(y, m.target);
        ops::mse_loss_backward(y, m.target, 1.0 / count, dy);
      }
      row.loss = 0.5 * par.sum_over_ranks(mine) / count;
    }
    // The branches' own losses (stage 10's auxiliary balance loss), whose gradients their
    // backward adds.
    if (extra) row.loss += par.sum_over_ranks(extra->loss_part());
    {
      TraceScope scope(trace, "backward", Lane::phase);
      for (std::size_t l = acts.size(); l-- > 0;) {
        const std::size_t kept = acts[l].bytes();
        const LayerParams w = par.layer_params(params, l, int(l) - 1);
        add(row.comm, par.take_comm_stats());  // the recompute's own traffic, counted apart
        recompute(l, w);
        add(row.recompute_comm, par.take_comm_stats());
        one_block = std::max(one_block, acts[l].bytes() - kept);
        LayerParams g = par.layer_grads(l, m.grads[l]);
        dy = block_backward(c, w, acts[l], dy, par, g, trace, mlp(l));
        par.grads_done(l, g, m.grads[l]);
        release(l);
        par.release_layer(l);
      }
      if (c.lm()) {
        const LmParams g = par.lm_grads(lm::embedding_end(m.lm_grads));
        lm::embed_backward(c, par, tokens.tokens, dy, g.embedding, trace);
        par.reduce_lm_grads(g, m.lm_grads);
      }
      par.finish_grads();
    }
    if (step == first) result.saved_activation_bytes = saved + one_block;
    row.grad_norm = grad_norm(par, m, sh, trace);
    if (result.diverged = divergence(row, c.lr); !result.diverged.empty()) {
      par.synchronize();
      ops::synchronize(c.device);
      break;  // no update from a non-finite gradient; the rows so far stay
    }
    par.synchronize();
    ops::synchronize(c.device);  // device work is asynchronous: stop the clock when it is done
    double ms = ms_since(t0);
    add(row.comm, par.take_comm_stats());
    add(row.comm, row.recompute_comm);
    row.exposed_comm_ms = trace.exposed_comm_ms(t0, Clock::now());

    if (step == first && snapshot) {  // outside the timed region; its gathers are not counted
      take_snapshot(c, par, m, c.lm() ? first_input : m.input, y, dy, batch, row.loss,
                    result.first);
      par.take_comm_stats();
    }
    if (c.evaluates(step)) row.eval_loss = held_out_loss(step);

    finish_step(c, par, m, moments, params, lm_params, trace, row, ms);
    checkpoints.after_step(row, trace);
    result.rows.push_back(row);
    if (on_row) on_row(row);
  }
  checkpoints.finish(result);
  if (extra) result.extra = extra->summary();
  if (c.generate.tokens > 0 && result.diverged.empty()) {
    gather_model(c, par, m, /*grads=*/false, result.trained);  // not a step's: reporting
    par.take_comm_stats();
  }
  return result;
}

ReferenceRun to_reference(const TrainResult& r) {
  auto widen = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  ReferenceRun ref;
  ref.output = widen(r.first.output);
  ref.input_grad = widen(r.first.input_grad);
  for (const auto& layer : r.first.grads) {
    auto& out = ref.grads.emplace_back();
    for (std::size_t p = 0; p < kNumParams; ++p) out[p] = widen(layer[p]);
  }
  for (std::size_t i = 0; i < ref.lm_grads.size(); ++i)
    ref.lm_grads[i] = widen(r.first.lm_grads[i]);
  for (const auto& row : r.rows) ref.losses.push_back(row.loss);
  return ref;
}

namespace {

template <class T>
CheckRow compare_one(std::string name, const std::vector<T>& got, const std::vector<double>& want,
                     double rtol) {
  CheckRow row{std::move(name)};
  if (got.size() != want.size()) {
    row.max_abs = row.max_rel = INFINITY;
    return row;
  }
  // A NaN would vanish from max() (every comparison with NaN is false), so non-finite values are
  // counted apart and fail the row; the errors are taken over the finite pairs.
  double scale = 0.0, dot = 0.0, gg = 0.0, ww = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = double(got[i]), w = want[i];
    if (!std::isfinite(g) || !std::isfinite(w)) {
      ++row.nonfinite;
      continue;
    }
    row.max_abs = std::max(row.max_abs, std::abs(g - w));
    scale = std::max(scale, std::abs(w));
    dot += g * w;
    gg += g * g;
    ww += w * w;
  }
  row.max_rel = scale > 0 ? row.max_abs / scale : row.max_abs;
  row.cosine = gg > 0 && ww > 0 ? dot / std::sqrt(gg * ww) : (gg == ww ? 1.0 : 0.0);
  row.ok = row.nonfinite == 0 && row.max_rel <= rtol;
  return row;
}

/// A gradient's row: on cosine similarity where the tolerance says so.
CheckRow compare_grad(std::string name, const std::vector<float>& got,
                      const std::vector<double>& want, const CheckTolerance& tol) {
  CheckRow row = compare_one(std::move(name), got, want, tol.rtol);
  if (tol.cosine > 0) row.ok = row.nonfinite == 0 && row.cosine >= tol.cosine;
  return row;
}

}  // namespace

std::vector<CheckRow> compare(const Snapshot& got, const std::vector<StepRow>& rows,
                              const ReferenceRun& want, const CheckTolerance& tol) {
  const double rtol = tol.rtol;
  std::vector<CheckRow> out;
  out.push_back(compare_one("output", got.output, want.output, rtol));
  out.push_back(compare_grad("input.grad", got.input_grad, want.input_grad, tol));
  for (std::size_t l = 0; l < want.grads.size() && l < got.grads.size(); ++l)
    for (Param p : kAllParams) {
      const auto i = static_cast<std::size_t>(p);
      if (want.grads[l][i].empty() && got.grads[l][i].empty()) continue;  // a MoE layer's MLP
      out.push_back(compare_grad(fmt::format("layers.{}.{}.grad", l, param_name(p)),
                                 got.grads[l][i], want.grads[l][i], tol));
    }
  if (want.grads.size() != got.grads.size())
    out.push_back({.name = "layer count", .max_abs = INFINITY, .max_rel = INFINITY});
  for (std::size_t i = 0; i < want.lm_grads.size(); ++i)
    if (!want.lm_grads[i].empty() || !got.lm_grads[i].empty())
      out.push_back(compare_grad(fmt::format("{}.grad", kLmParamNames[i]), got.lm_grads[i],
                                 want.lm_grads[i], tol));
  // Stage 10's experts, by name: every one the reference has, and none it lacks.
  for (const NamedArray<double>& w : want.extra_grads) {
    const auto it =
        std::ranges::find_if(got.extra_grads, [&](const auto& g) { return g.name == w.name; });
    out.push_back(compare_grad(w.name + ".grad",
                               it == got.extra_grads.end() ? std::vector<float>{} : it->values,
                               w.values, tol));
  }
  for (const NamedArray<float>& g : got.extra_grads)
    if (std::ranges::none_of(want.extra_grads, [&](const auto& w) { return w.name == g.name; }))
      out.push_back({.name = g.name + ".grad (not in the reference)",
                     .max_abs = INFINITY,
                     .max_rel = INFINITY});
  for (std::size_t s = 0; s < want.losses.size(); ++s) {
    const double g = s < rows.size() ? rows[s].loss : NAN;
    out.push_back(compare_one(fmt::format("loss after {} update{}", s, s == 1 ? "" : "s"),
                              std::vector<double>{g}, {want.losses[s]},
                              tol.loss_rtol > 0 ? tol.loss_rtol : rtol));
  }
  return out;
}

namespace training {

Checkpoints::Checkpoints(const BlockConfig& c, const Sharding& sh, Model& m, Moments& moments)
    : c_(c), sh_(sh), m_(m), moments_(moments) {
  // --resume: the state of the checkpoint's step, this rank's part of it read from the shards
  // that hold it (in whatever cut they were saved); every rank stops if any cannot.
  if (!c.checkpoint.resume_dir.empty()) {
    const std::string problem = load_checkpoint(c, sh, state_tensors(m, moments));
    if (const StartVerdict v = agree_to_start(!problem.empty(), 2, problem); v.stop)
      throw ConfigError(v.message);
  }
  // --async-save: the saves' writer thread, with a communicator of its own.
  if (c.checkpoint.async_save) writer_.emplace();
}

int Checkpoints::first_step() const {
  return static_cast<int>(c_.checkpoint.resume_step);
}

void Checkpoints::after_step(StepRow& row, Trace& trace) {
  if (!c_.checkpoint.saves_after(row.step + 1, c_.steps)) return;
  // After the update: the next step's state.
  const auto t1 = Clock::now();
  TraceScope phase(trace, "save", Lane::phase);
  const auto all = state_tensors(m_, moments_);
  CheckpointSnapshot state = snapshot_state(c_, sh_, {all.begin(), all.end()}, row.step + 1);
  row.saved = state.dir.string();
  row.save_async = writer_.has_value();
  if (writer_)  // the host copy taken, the step loop goes on while the thread writes it
    writer_->start(c_, sh_, std::move(state));
  else
    save_checkpoint(c_, sh_, state);
  row.save_ms = ms_since(t1);
}

void Checkpoints::finish(TrainResult& result) {
  if (!writer_) return;
  // The last save's writing, after the last step: the run's, not a step's.
  const auto t1 = Clock::now();
  writer_->wait();
  result.extra["save_final_wait_ms"] = ms_since(t1);
}

std::vector<Tensor*> state_tensors(Model& m, Moments& moments) {
  std::vector<Tensor*> out;
  auto add = [&](const std::vector<LayerParams*>& layers,
                 const std::array<Tensor*, kLmParams>& lm) {
    for (LayerParams* layer : layers)
      for (Param p : kAllParams) out.push_back(&(*layer)[p]);
    for (Tensor* t : lm)
      if (t->defined()) out.push_back(t);
  };
  std::vector<LayerParams*> layers;
  for (LayerParams& l : m.params) layers.push_back(&l);
  add(layers, {&m.lm.embedding, &m.lm.norm_f, &m.lm.w_out});
  for (std::size_t k = 0; k < 2 && !moments.layers.empty(); ++k) {
    layers.clear();
    for (auto& mv : moments.layers) layers.push_back(&mv[k]);
    add(layers, {&moments.lm[k][0], &moments.lm[k][1], &moments.lm[k][2]});
  }
  return out;
}

}  // namespace training
}  // namespace tpx
