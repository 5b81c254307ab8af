#include "model.h"

#include <algorithm>

#include "check.h"
#include "init.h"
#include "ops.h"

namespace tpx {

std::string_view param_name(Param p) {
  static constexpr std::array<std::string_view, kNumParams> names = {
      "norm1", "wq", "wk", "wv", "wo", "norm2", "w_gate", "w_up", "w_down"};
  return names[static_cast<std::size_t>(p)];
}

Split param_split(Param p) {
  switch (p) {
    case Param::norm1:
    case Param::norm2:
      return Split::replicated;
    case Param::wo:
    case Param::w_down:
      return Split::rows;
    default:
      return Split::columns;
  }
}

std::vector<std::int64_t> param_shape(Param p, const BlockConfig& c) {
  switch (p) {
    case Param::norm1:
    case Param::norm2:
      return {c.hidden};
    case Param::w_gate:
    case Param::w_up:
      return {c.hidden, c.ffn};
    case Param::w_down:
      return {c.ffn, c.hidden};
    case Param::wk:
    case Param::wv:
      return {c.hidden, c.kv_dim()};  // NKV·D: grouped-query attention's fewer KV heads
    default:
      return {c.hidden, c.hidden};
  }
}

std::vector<std::int64_t> param_local_shape(Param p, const BlockConfig& c, const Sharding& s) {
  auto shape = param_shape(p, c);
  if (!s.weights) return shape;
  switch (param_split(p)) {
    case Split::columns:
      shape[1] /= s.world;
      break;
    case Split::rows:
      shape[0] /= s.world;
      break;
    case Split::replicated:
      break;
  }
  return shape;
}

std::vector<std::int64_t> param_offset(Param p, const BlockConfig& c, const Sharding& s) {
  const auto local = param_local_shape(p, c, s);
  std::vector<std::int64_t> at(local.size(), 0);
  if (s.weights && param_split(p) == Split::columns) at[1] = s.rank * local[1];
  if (s.weights && param_split(p) == Split::rows) at[0] = s.rank * local[0];
  return at;
}

namespace {

// Generates on the host (the initialiser is a host function) and moves to the run's device.
Tensor generate(std::vector<std::int64_t> shape, const BlockConfig& c, std::uint64_t id,
                const Window& w, double mean, double std) {
  Tensor host = Tensor::empty(std::move(shape));
  fill_normal(host, c.seed, id, w, mean, std);
  return c.device == Device::cpu ? host : ops::to_device(host, c.device);
}

}  // namespace

VocabShard vocab_shard(const BlockConfig& c, const Sharding& s) {
  const std::int64_t parts = s.weights ? s.world : 1;
  const std::int64_t local = (c.vocab + parts - 1) / parts;
  return {.begin = s.weights ? s.rank * local : 0, .local = local, .padded = local * parts};
}

namespace {

/// The language model's tensors of this rank: the embedding's rows and the output layer's
/// columns of its vocabulary range (their padding zero), the final gain.
void make_lm(const BlockConfig& c, const Sharding& s, Model& m) {
  const VocabShard v = vocab_shard(c, s);
  const std::int64_t real = v.real(c.vocab);
  const std::int64_t h = c.hidden;
  // Generated on the host: the real rows (columns) drawn from the full [V, H] ([H, V]) tensor's
  // elements, the padding left zero.
  Tensor e = Tensor::empty({v.local, h}), w = Tensor::empty({h, v.local});
  ops::fill(e, 0.0f);
  ops::fill(w, 0.0f);
  if (real > 0) {
    Tensor rows = e.slice0(0, real);
    fill_normal(rows, c.seed, TensorId::embedding, {h, v.begin, 0}, 0.0, 0.02);
    Tensor cols = Tensor::empty({h, real});
    fill_normal(cols, c.seed, TensorId::w_out, {c.vocab, 0, v.begin}, 0.0, 0.02);
    auto from = cols.f32(), to = w.f32();
    for (std::int64_t i = 0; i < h; ++i)
      std::copy_n(from.begin() + i * real, real, to.begin() + i * v.local);
  }
  Tensor g = Tensor::empty({h});
  ops::fill(g, 1.0f);
  auto on_device = [&](const Tensor& t) {
    return c.device == Device::cpu ? t : ops::to_device(t, c.device);
  };
  m.lm = {.embedding = on_device(e), .norm_f = on_device(g), .w_out = on_device(w)};
  for (auto [param, grad] : {std::pair{&m.lm.embedding, &m.lm_grads.embedding},
                             {&m.lm.norm_f, &m.lm_grads.norm_f},
                             {&m.lm.w_out, &m.lm_grads.w_out}})
    *grad = Tensor::empty(param->shape(), DType::f32, c.device);
}

}  // namespace

Tensor make_data(const BlockConfig& c, bool target, std::int64_t begin, std::int64_t end) {
  TPX_CHECK(0 <= begin && begin <= end && end <= c.seq, "sequence rows [{}, {}) of {}", begin, end,
            c.seq);
  const Window w{c.hidden, begin * c.batch, 0};
  return generate({end - begin, c.batch, c.hidden}, c, target ? TensorId::target : TensorId::input,
                  w, 0.0, 1.0);
}

Model make_model(const BlockConfig& c, const Sharding& s) {
  std::vector<std::int64_t> all(static_cast<std::size_t>(c.layers));
  for (std::size_t l = 0; l < all.size(); ++l) all[l] = std::int64_t(l);
  return make_model(c, s, all);
}

Model make_model(const BlockConfig& c, const Sharding& s, const std::vector<std::int64_t>& layers) {
  TPX_CHECK(s.world >= 1 && s.rank >= 0 && s.rank < s.world, "bad sharding {}/{}", s.rank, s.world);
  Model m;
  const std::int64_t seq_local = s.sequence ? c.seq / s.world : c.seq;
  const std::int64_t first = s.sequence ? s.rank * seq_local : 0;
  if (c.lm()) {
    make_lm(c, s, m);
  } else {
    m.input = make_data(c, false, first, first + seq_local);
    m.target = make_data(c, true, first, first + seq_local);
  }
  for (const std::int64_t l : layers) {
    TPX_CHECK(0 <= l && l < c.layers, "layer {} of {}", l, c.layers);
    LayerParams p, g;
    // A layer whose MLP is stage 10's mixture of experts has no dense SwiGLU: its w_gate, w_up
    // and w_down are empty ([H, 0] and [0, H]; the experts are the stage's own parameters).
    BlockConfig shapes = c;
    if (c.moe.layer(l)) shapes.ffn = 0;
    for (Param q : kAllParams) {
      const auto full = param_shape(q, shapes);
      const auto local = param_local_shape(q, shapes, s);
      const auto at = param_offset(q, shapes, s);
      const Window w{full.back(), at[0], at.size() > 1 ? at[1] : 0};
      const bool gain = param_split(q) == Split::replicated;
      p[q] = generate(local, c, TensorId::layer(l, static_cast<int>(q)), w, gain ? 1.0 : 0.0,
                      gain ? 0.0 : 0.02);
      g[q] = Tensor::empty(local, DType::f32, c.device);
    }
    m.params.push_back(std::move(p));
    m.grads.push_back(std::move(g));
  }
  return m;
}

}  // namespace tpx
