#include "09_pipeline_parallel/executor.h"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "09_pipeline_parallel/channels.h"
#include "common/check.h"
#include "common/ops.h"

namespace tpx::pp {

using pipeline::Action;
using pipeline::LayerRange;
using pipeline::Payload;
using pipeline::Phase;
using pipeline::Transfer;
using training::add;

namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

Executor::Executor(const BlockConfig& c, PipelineParallel& pp, Model& model, Trace& trace)
    : c_(c),
      pp_(pp),
      slice_(pp.slice()),
      m_(model),
      trace_(trace),
      shape_(pp.schedule().shape()),
      me_(pp.mesh().pp_index),
      actions_(pp.schedule().actions(me_)),
      split_(pp.schedule().split_backward()) {
  const std::vector<std::int64_t> held = pp.held_layers();
  for (std::size_t i = 0; i < held.size(); ++i) local_[held[i]] = i;
  std::vector<Transfer> sends, receives;
  for (const Transfer& x : pipeline::transfers(pp.schedule(), me_))
    (x.send ? sends : receives).push_back(x);
  sends_ = ByAction(std::move(sends), actions_.size());
  receives_ = ByAction(std::move(receives), actions_.size());
}

Executor::Result Executor::run(const std::vector<LayerParams>& params, bool keep) {
  Result r;
  saved_ = 0;
  passes_.clear();
  buffers_.clear();
  local_messages_.clear();
  acc_.clear();
  done_.clear();
  // Each payload's sends run in order on its lane: the last one's end is the end of all.
  std::optional<Event> sent[2];
  int live = 0;
  if (keep) {
    r.x.resize(std::size_t(shape_.microbatches));
    r.y.resize(std::size_t(shape_.microbatches));
    r.dx.resize(std::size_t(shape_.microbatches));
  }
  // The language model's gradients, summed over the micro-batches from zero in the slice's
  // buffers (FSDP's unsharded ones), reduced after the last.
  lm_acc_ = c_.lm() ? slice_.lm_grads(m_.lm_grads) : LmParams{};
  for (const Tensor* g : lm_acc_.all())
    if (g->defined()) ops::fill(*g, 0.0f);
  for (std::size_t i = 0; i < actions_.size(); ++i) {
    for (std::size_t j = i; j < actions_.size() && j <= i + pipeline::kReceivesAhead; ++j)
      post_receives(j);  // ahead of the action that reads them
    const Action& a = actions_[i];
    // The compute stream waits for the messages this action reads. The host goes on issuing:
    // with NCCL nothing blocks; a host lane's event makes this thread wait until the lane's
    // thread has made the transfer (the cpu's default stream waits the same way).
    const Stream compute(c_.device);
    for (const Transfer& x : receives_.at(i)) buffers_.at(x.tag).second.wait(compute);
    const auto t0 = Clock::now();
    {
      TraceScope phase(trace_, pipeline::to_string(a, shape_.stages_per_rank > 1), Lane::phase);
      if (a.phase == Phase::forward)
        forward(i, params, r, keep);
      else if (a.phase == Phase::backward)
        backward(i, params, r, keep);
      else
        weights(a);
    }
    r.busy_ms += ms_between(t0, Clock::now());
    if (a.phase == Phase::forward) ++live;
    if (a.phase == Phase::weight || (a.phase == Phase::backward && !split_)) --live;
    r.peak_live = std::max(r.peak_live, live);
    if (a.phase == Phase::forward) r.peak_saved = std::max(r.peak_saved, saved_);
    if (a.phase != Phase::weight) pass_on(i, sent);
    // The pass keeps only what its later actions read: the send lane holds what it sends
    // until it is gone, and the stage input is the first layer's saved x.
    if (const auto it = passes_.find({a.microbatch, a.stage}); it != passes_.end())
      it->second.x = it->second.y = it->second.dx = Tensor();
    // A pass whose last use is over lets go of what it holds.
    if (a.phase == Phase::weight || (a.phase == Phase::backward && !split_))
      passes_.erase({a.microbatch, a.stage});
  }
  for (const std::optional<Event>& e : sent)
    if (e) e->synchronize();
  scratch_ = {};
  lm_scratch_ = {};
  if (c_.lm()) slice_.reduce_lm_grads(lm_acc_, m_.lm_grads);
  slice_.finish_grads();
  lm_acc_ = {};
  return r;
}

double Executor::evaluate(const std::vector<LayerParams>& params,
                          const std::vector<lm::RankTokens>& batch) {
  const int last = shape_.stages() - 1;
  const Stream compute(c_.device);
  auto message = [&](int j, int from, bool send) {
    const int to = from + 1;
    return Transfer{.send = send,
                    .payload = Payload::activation,
                    .microbatch = j,
                    .from_stage = from,
                    .to_stage = to,
                    .peer = shape_.rank_of(send ? to : from),
                    .tag = -1,  // not the step's: no tag of message_tag()
                    .action = 0};
  };
  auto message_name = [](int j, int from) {
    return fmt::format("eval act {} stage {}→{}", j, from, from + 1);
  };
  double loss_sum = 0;
  for (int j = 0; j < shape_.microbatches; ++j) {
    Tensor h;  // the activation between consecutive virtual stages when this rank holds both
    for (const int s : shape_.stages_of(me_)) {
      const auto mb = std::size_t(j);
      if (s == 0) {
        h = lm::embed(c_, slice_, slice_.lm_params(lm::embedding_end(lm_params)).embedding,
                      batch[mb].tokens, trace_);
      } else if (shape_.rank_of(s - 1) != me_) {
        h = Tensor::empty(message_shape, c_.activations(), c_.device);
        pp_.receive(message(j, s - 1, /*send=*/false), h, message_name(j, s - 1)).wait(compute);
      }
      const LayerRange& range = pp_.layers()[std::size_t(s)];
      for (int k = 0; k < range.count; ++k) {
        const std::size_t l = local_.at(range.first + k);
        const int next = k + 1 < range.count ? int(l + 1) : -1;
        const LayerParams w = slice_.layer_params(params, l, next);
        BlockActivations dropped;  // forward only: what the layer saves goes at once
        h = block_forward(c_, w, h, slice_, dropped, trace_, branch(l, j));
        slice_.release_layer(l);
      }
      if (s == last) {
        lm::HeadActivations head;
        loss_sum += lm::head_forward(c_, slice_, slice_.lm_params(lm::head_end(lm_params)), h,
                                     batch[mb].targets, head, trace_);
      } else if (shape_.rank_of(s + 1) != me_) {
        pp_.send(message(j, s, /*send=*/true), h, message_name(j, s));
      }
    }
  }
  return loss_sum;
}

void Executor::pass_on(std::size_t i, std::optional<Event> (&sent)[2]) {
  const Action& a = actions_[i];
  const bool fwd = a.phase == Phase::forward;
  const int to = fwd ? a.stage + 1 : a.stage - 1;
  if (to < 0 || to >= shape_.stages()) return;
  const Pass& pass = passes_.at({a.microbatch, a.stage});
  const Tensor& t = fwd ? pass.y : pass.dx;
  if (shape_.rank_of(to) == me_)
    local_messages_[{a.microbatch, to, fwd ? Payload::activation : Payload::gradient}] = t;
  for (const Transfer& x : sends_.at(i)) sent[std::size_t(x.payload)] = pp_.send(x, t, name(x));
}

std::string Executor::name(const Transfer& x) {
  return fmt::format("{} {} stage {}→{}", x.payload == Payload::activation ? "act" : "grad",
                     x.microbatch, x.from_stage, x.to_stage);
}

void Executor::post_receives(std::size_t i) {
  for (const Transfer& x : receives_.at(i))
    if (!buffers_.contains(x.tag)) {
      Tensor buf = Tensor::empty(message_shape, c_.activations(), c_.device);
      buffers_.emplace(x.tag, std::make_pair(buf, pp_.receive(x, buf, name(x))));
    }
}

/// The input of action i (a forward's activation, a backward's output gradient): received,
/// or left on this rank by the neighbouring virtual stage.
Tensor Executor::incoming(std::size_t i, Payload payload) {
  const Action& a = actions_[i];
  for (const Transfer& x : receives_.at(i))
    if (x.payload == payload) {
      Tensor t = buffers_.at(x.tag).first;
      buffers_.erase(x.tag);
      return t;
    }
  const auto it = local_messages_.find({a.microbatch, a.stage, payload});
  TPX_CHECK(it != local_messages_.end(), "no {} for {}",
            payload == Payload::activation ? "activation" : "gradient", to_string(a, true));
  Tensor t = it->second;
  local_messages_.erase(it);
  return t;
}

void Executor::forward(std::size_t i, const std::vector<LayerParams>& params, Result& r,
                       bool keep) {
  const Action& a = actions_[i];
  Pass& p = passes_[{a.microbatch, a.stage}];
  const auto j = std::size_t(a.microbatch);
  if (a.stage != 0)
    p.x = incoming(i, Payload::activation);
  else if (c_.lm())
    p.x = lm::embed(c_, slice_, slice_.lm_params(lm::embedding_end(lm_params)).embedding,
                    tokens[j].tokens, trace_);
  else
    p.x = inputs[j];
  if (keep && a.stage == 0) r.x[j] = p.x;
  const LayerRange& range = pp_.layers()[std::size_t(a.stage)];
  p.acts.resize(std::size_t(range.count));
  Tensor h = p.x;
  for (int k = 0; k < range.count; ++k) {
    const std::size_t l = local_.at(range.first + k);
    const int next = k + 1 < range.count ? int(l + 1) : -1;
    const LayerParams w = slice_.layer_params(params, l, next);
    MlpBranch* mlp = branch(l, a.microbatch);
    h = block_forward(c_, w, h, slice_, p.acts[std::size_t(k)], trace_, mlp);
    release(range.first + k, p.acts[std::size_t(k)]);
    saved_ += p.acts[std::size_t(k)].bytes() + (mlp ? mlp->saved_bytes() : 0);
    slice_.release_layer(l);
  }
  p.y = h;
  if (a.stage == shape_.stages() - 1 && c_.lm()) {
    // The language model's head on this micro-batch, its loss part of the mean over every
    // position of the batch (its gradient scaled by 1 / (S·B)).
    // (FSDP: the head's weights gathered for it, and let go after it.)
    lm::HeadActivations head;
    const LmParams w = slice_.lm_params(lm::head_end(lm_params));
    r.loss_sum += lm::head_forward(c_, slice_, w, h, tokens[j].targets, head, trace_);
    const LmParams g = lm_scratch();
    p.dy = lm::head_backward(c_, slice_, w, head, tokens[j].targets,
                             1.0 / (double(c_.seq) * double(c_.batch)), g, trace_);
    accumulate_lm({.embedding = {}, .norm_f = g.norm_f, .w_out = g.w_out});
    if (keep) r.y[j] = h;
  } else if (a.stage == shape_.stages() - 1) {
    // The loss of this micro-batch, as part of the mean over the whole batch: its gradient is
    // scaled by 1 / (S·B·H), which is 1/M of the micro-batch's own mean.
    TraceScope op(trace_, "mse loss");
    const Tensor& target = targets[std::size_t(a.microbatch)];
    r.loss_sum += ops::mse_loss_sum(h, target);
    p.dy = Tensor::empty(h.shape(), h.dtype(), h.device());
    const double count = double(c_.seq) * double(c_.batch) * double(c_.hidden);
    ops::mse_loss_backward(h, target, 1.0 / count, p.dy);
    if (keep) r.y[std::size_t(a.microbatch)] = h;
  }
}

void Executor::backward(std::size_t i, const std::vector<LayerParams>& params, Result& r,
                        bool keep) {
  const Action& a = actions_[i];
  Pass& p = passes_.at({a.microbatch, a.stage});
  Tensor dy = a.stage == shape_.stages() - 1 ? p.dy : incoming(i, Payload::gradient);
  const LayerRange& range = pp_.layers()[std::size_t(a.stage)];
  if (split_) {
    TPX_CHECK(slice_.defer_weight_grads(&p.work), "the stage cannot split its backward");
    p.grads.resize(std::size_t(range.count));
  }
  for (int k = range.count - 1; k >= 0; --k) {
    const std::size_t l = local_.at(range.first + k);
    const int next = k > 0 ? int(l - 1) : -1;
    const LayerParams w = slice_.layer_params(params, l, next);
    LayerParams g = fresh_grads(l);
    remake(range.first + k, w, p.acts[std::size_t(k)], r);
    MlpBranch* mlp = branch(l, a.microbatch);
    const std::size_t branch_saved = mlp ? mlp->saved_bytes() : 0;
    dy = block_backward(c_, w, p.acts[std::size_t(k)], dy, slice_, g, trace_, mlp);
    slice_.release_layer(l);
    saved_ -= p.acts[std::size_t(k)].bytes() + branch_saved;
    p.acts[std::size_t(k)] = {};
    if (split_)
      p.grads[std::size_t(k)] = g;
    else
      accumulate(l, g);
  }
  if (split_) slice_.defer_weight_grads(nullptr);
  p.dx = dy;
  if (keep && a.stage == 0) r.dx[std::size_t(a.microbatch)] = dy;
  if (a.stage == 0 && c_.lm()) {
    const LmParams g = lm_scratch();
    lm::embed_backward(c_, slice_, tokens[std::size_t(a.microbatch)].tokens, dy, g.embedding,
                       trace_);
    accumulate_lm({.embedding = g.embedding, .norm_f = {}, .w_out = {}});
  }
}

MlpBranch* Executor::branch(std::size_t l, int microbatch) {
  ExtraParameters* extra = slice_.extra_parameters();
  if (!extra) return nullptr;
  extra->microbatch(microbatch, shape_.microbatches);
  return extra->mlp(l);
}

void Executor::release(std::int64_t layer, BlockActivations& saved) const {
  if (c_.recomputes_layer(layer))
    saved.keep_only_input();
  else if (c_.recompute == Recompute::selective)
    saved.drop_cheap();
}

void Executor::remake(std::int64_t layer, const LayerParams& w, BlockActivations& saved,
                      Result& r) {
  const std::size_t kept = saved.bytes();
  if (c_.recomputes_layer(layer)) {
    // The block's forward again from its saved input, collectives included (their traffic
    // counted apart, as train() counts it); its output is already the next layer's input.
    add(r.comm, slice_.take_comm_stats());
    {
      TraceScope again(trace_, "recompute", Lane::phase);
      block_forward(c_, w, saved.x, slice_, saved, trace_);
    }
    add(r.recompute_comm, slice_.take_comm_stats());
  } else if (c_.recompute == Recompute::selective) {
    block_refill(w, slice_, saved, trace_);
  }
  saved_ += saved.bytes() - kept;  // one block whole again, until its backward is done
  r.peak_saved = std::max(r.peak_saved, saved_);
}

void Executor::weights(const Action& a) {
  Pass& p = passes_.at({a.microbatch, a.stage});
  p.work.run();  // the dW GEMMs, writing p.grads
  const LayerRange& range = pp_.layers()[std::size_t(a.stage)];
  for (int k = 0; k < range.count; ++k)
    accumulate(local_.at(range.first + k), p.grads[std::size_t(k)]);
}

/// Buffers for one micro-batch's gradients of layer l (the slice's full-layer shapes). Without
/// the split they are added to the step's at once, so every layer and micro-batch reuses one
/// set (in stream order: its adds are issued before the next backward's GEMMs overwrite it);
/// zb-h1's live from B to W, a set per (micro-batch, layer) between them.
LayerParams Executor::fresh_grads(std::size_t l) {
  LayerParams& acc = accumulator(l);
  const bool reuse =
      !split_ && scratch_[Param::norm1].defined() && std::ranges::all_of(kAllParams, [&](Param q) {
        return scratch_[q].shape() == acc[q].shape();
      });
  if (reuse) return scratch_;
  LayerParams g;
  for (Param q : kAllParams) g[q] = Tensor::empty(acc[q].shape(), DType::f32, c_.device);
  if (!split_) scratch_ = g;
  return g;
}

/// The gradients layer l accumulates over the step's micro-batches (the slice's buffers:
/// the stored ones, or FSDP's unsharded ones), zero at the first.
LayerParams& Executor::accumulator(std::size_t l) {
  auto it = acc_.find(l);
  if (it == acc_.end()) {
    it = acc_.emplace(l, slice_.layer_grads(l, m_.grads[l])).first;
    for (Param q : kAllParams) ops::fill(it->second[q], 0.0f);
  }
  return it->second;
}

/// Adds one micro-batch's gradients of layer l; after the M-th, the slice reduces them.
void Executor::accumulate(std::size_t l, const LayerParams& g) {
  LayerParams& acc = accumulator(l);
  {
    TraceScope op(trace_, "grad accumulate");
    for (Param q : kAllParams) ops::accumulate(g[q], acc[q]);
  }
  if (++done_[l] == shape_.microbatches) {
    slice_.grads_done(l, acc, m_.grads[l]);
    acc_.erase(l);
  }
}

LmParams Executor::lm_scratch() {
  if (!lm_scratch_.norm_f.defined() && !lm_scratch_.embedding.defined()) {
    auto like = [&](const Tensor& t) {
      return t.defined() ? Tensor::empty(t.shape(), DType::f32, c_.device) : Tensor();
    };
    lm_scratch_ = {like(lm_acc_.embedding), like(lm_acc_.norm_f), like(lm_acc_.w_out)};
  }
  return lm_scratch_;
}

void Executor::accumulate_lm(const LmParams& g) {
  TraceScope op(trace_, "grad accumulate");
  const auto from = g.all(), into = lm_acc_.all();
  for (std::size_t i = 0; i < from.size(); ++i)
    if (from[i]->defined() && into[i]->defined()) ops::accumulate(*from[i], *into[i]);
}

}  // namespace tpx::pp
