#include "moe_model.h"

#include <algorithm>

#include <fmt/format.h>

#include "init.h"

namespace tpx {
namespace {

using I = std::int64_t;

using moe_detail::at;

/// Rows [outer, inner, h] as [inner, outer, h].
template <class T>
HostVector<T> transposed(const T* rows, I outer, I inner, I h) {
  HostVector<T> out(at(outer * inner * h));
  for (I o = 0; o < outer; ++o)
    for (I i = 0; i < inner; ++i)
      std::copy_n(rows + (o * inner + i) * h, h, out.begin() + (i * outer + o) * h);
  return out;
}

/// Elements [first, first + n) of tensor `id` ~ N(0, 0.02²), each rounded to float.
template <class T>
HostVector<T> draw(const BlockConfig& c, std::uint64_t id, I first, I n) {
  HostVector<T> v(at(n));
  for (I i = 0; i < n; ++i)
    v[at(i)] = T(float(0.02 * normal_at(c.seed, id, std::uint64_t(first + i))));
  return v;
}

/// Columns [c0, c0 + width) of matrices m = first … first + count − 1 of tensor `id`, each
/// [rows, cols]: [count, rows, width].
template <class T>
HostVector<T> draw_columns(const BlockConfig& c, std::uint64_t id, I first, I count, I rows, I cols,
                           I c0, I width) {
  HostVector<T> v;
  v.reserve(at(count * rows * width));
  for (I m = first; m < first + count; ++m)
    for (I i = 0; i < rows; ++i) {
      const HostVector<T> row = draw<T>(c, id, (m * rows + i) * cols + c0, width);
      v.insert(v.end(), row.begin(), row.end());
    }
  return v;
}

}  // namespace

template <class T>
MoeWeights<T> moe_init(const BlockConfig& c, I layer, I first, I count, I tp_rank, I tp) {
  const MoeConfig& m = c.moe;
  const I H = c.hidden, E = m.experts, FE = m.expert_ffn, SF = m.shared_ffn;
  const I fe = FE / tp, sf = SF / tp;
  auto id = [&](int i) { return TensorId::layer(layer, kMoeRouterId + i); };
  MoeWeights<T> w;
  w.router = draw<T>(c, id(0), 0, H * E);
  w.w_gate = draw_columns<T>(c, id(1), first, count, H, FE, tp_rank * fe, fe);
  w.w_up = draw_columns<T>(c, id(2), first, count, H, FE, tp_rank * fe, fe);
  // w_down [FE, H]: rows [r·fe, (r+1)·fe) of each expert, a whole [fe, H] block.
  for (I e = first; e < first + count; ++e) {
    const HostVector<T> rows = draw<T>(c, id(3), (e * FE + tp_rank * fe) * H, fe * H);
    w.w_down.insert(w.w_down.end(), rows.begin(), rows.end());
  }
  if (SF > 0) {
    w.shared_gate = draw_columns<T>(c, id(4), 0, 1, H, SF, tp_rank * sf, sf);
    w.shared_up = draw_columns<T>(c, id(5), 0, 1, H, SF, tp_rank * sf, sf);
    w.shared_down = draw<T>(c, id(6), tp_rank * sf * H, sf * H);
  }
  return w;
}

std::vector<std::string> moe_tensor_names(const MoeConfig& m, I layer, I first, I count) {
  std::vector<std::string> names = {fmt::format("layers.{}.router", layer)};
  for (I e = first; e < first + count; ++e)
    for (const char* p : {"w_gate", "w_up", "w_down"})
      names.push_back(fmt::format("layers.{}.experts.{}.{}", layer, e, p));
  if (m.shared_ffn > 0)
    for (const char* p : {"w_gate", "w_up", "w_down"})
      names.push_back(fmt::format("layers.{}.shared.{}", layer, p));
  return names;
}

template <class T, class V>
std::vector<NamedArray<T>> moe_named(const MoeConfig& m, const MoeWeights<T, V>& w, I layer,
                                     I first) {
  const I H = I(w.router.size()) / m.experts, FE = m.expert_ffn, SF = m.shared_ffn;
  const I count = FE > 0 ? I(w.w_gate.size()) / (H * FE) : 0;
  const std::vector<std::string> names = moe_tensor_names(m, layer, first, count);
  std::vector<NamedArray<T>> out;
  std::size_t n = 0;
  auto add = [&](std::vector<std::int64_t> shape, const V& all, I part) {
    const I size = shape[0] * shape[1];
    out.push_back({names[n++], std::move(shape),
                   std::vector<T>(all.begin() + part * size, all.begin() + (part + 1) * size)});
  };
  add({H, m.experts}, w.router, 0);
  for (I e = 0; e < count; ++e) {
    add({H, FE}, w.w_gate, e);
    add({H, FE}, w.w_up, e);
    add({FE, H}, w.w_down, e);
  }
  if (SF > 0) {
    add({H, SF}, w.shared_gate, 0);
    add({H, SF}, w.shared_up, 0);
    add({SF, H}, w.shared_down, 0);
  }
  return out;
}

template <class T>
HostVector<T> to_sequence_major(const T* rows, I seq, I b, I h) {
  return transposed(rows, seq, b, h);
}

template <class T>
HostVector<T> from_sequence_major(const T* rows, I seq, I b, I h) {
  return transposed(rows, b, seq, h);
}

#define TPX_MOE_MODEL(T)                                                                          \
  template MoeWeights<T> moe_init<T>(const BlockConfig&, I, I, I, I, I);                          \
  template std::vector<NamedArray<T>> moe_named<T>(const MoeConfig&, const MoeWeights<T>&, I, I); \
  template std::vector<NamedArray<T>> moe_named<T>(const MoeConfig&,                              \
                                                   const MoeWeights<T, std::vector<T>>&, I, I);   \
  template HostVector<T> to_sequence_major<T>(const T*, I, I, I);                                 \
  template HostVector<T> from_sequence_major<T>(const T*, I, I, I);
TPX_MOE_MODEL(float)
TPX_MOE_MODEL(double)
#undef TPX_MOE_MODEL

}  // namespace tpx
