#include "model.h"

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

namespace {

// Generates on the host (the initialiser is a host function) and moves to the run's device.
Tensor generate(std::vector<std::int64_t> shape, const BlockConfig& c, std::uint64_t id,
                const Window& w, double mean, double std) {
  Tensor host = Tensor::empty(std::move(shape));
  fill_normal(host, c.seed, id, w, mean, std);
  return c.device == Device::cpu ? host : ops::to_device(host, c.device);
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
  m.input = make_data(c, false, first, first + seq_local);
  m.target = make_data(c, true, first, first + seq_local);
  for (const std::int64_t l : layers) {
    TPX_CHECK(0 <= l && l < c.layers, "layer {} of {}", l, c.layers);
    LayerParams p, g;
    for (Param q : kAllParams) {
      const auto full = param_shape(q, c);
      const auto local = param_local_shape(q, c, s);
      Window w{full.back(), 0, 0};
      if (s.weights && param_split(q) == Split::columns) w.col0 = s.rank * local[1];
      if (s.weights && param_split(q) == Split::rows) w.row0 = s.rank * local[0];
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
