// Plain loops in double, the linear layers' products through BLAS's dgemm. Matrices are row-major
// std::vector<double>; a "token" is one (s, b) position, token index t = s·B + b.
#include "reference.h"

#include <cblas.h>  // defines: cblas_dgemm

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>

#include "data.h"
#include "init.h"
#include "moe.h"
#include "moe_model.h"

namespace tpx {
namespace {

using Vec = std::vector<double>;
using I = std::int64_t;

// m's values as a stage stores them in bf16: rounded to fp32, then to bf16 (nearest even).
Vec bf16_rounded(const Vec& m) {
  Vec out(m.size());
  for (std::size_t i = 0; i < m.size(); ++i)
    out[i] = double(bf16_value(bf16_bits(static_cast<float>(m[i]))));
  return out;
}

Vec normal(const BlockConfig& c, std::uint64_t id, I n, double mean, double std) {
  Vec v(static_cast<std::size_t>(n));
  for (I i = 0; i < n; ++i)
    v[static_cast<std::size_t>(i)] =
        double(float(mean + std * normal_at(c.seed, id, std::uint64_t(i))));
  return v;
}

// The three products of a linear layer, in double through BLAS (dgemm computes each sum in its own
// order; every other loop of the reference is written out below). Row-major, as everything here.
int blas_int(I n) {
  return static_cast<int>(n);
}

// Y[t, o] = Σ_i X[t, i] W[i, o]
Vec matmul(const Vec& x, const Vec& w, I rows, I in, I out) {
  Vec y(static_cast<std::size_t>(rows * out), 0.0);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, blas_int(rows), blas_int(out),
              blas_int(in), 1.0, x.data(), blas_int(in), w.data(), blas_int(out), 0.0, y.data(),
              blas_int(out));
  return y;
}

// dX[t, i] = Σ_o dY[t, o] W[i, o]
Vec matmul_dx(const Vec& dy, const Vec& w, I rows, I in, I out) {
  Vec dx(static_cast<std::size_t>(rows * in), 0.0);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, blas_int(rows), blas_int(in), blas_int(out),
              1.0, dy.data(), blas_int(out), w.data(), blas_int(out), 0.0, dx.data(), blas_int(in));
  return dx;
}

// dW[i, o] = Σ_t X[t, i] dY[t, o]
Vec matmul_dw(const Vec& x, const Vec& dy, I rows, I in, I out) {
  Vec dw(static_cast<std::size_t>(in * out), 0.0);
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, blas_int(in), blas_int(out), blas_int(rows),
              1.0, x.data(), blas_int(in), dy.data(), blas_int(out), 0.0, dw.data(), blas_int(out));
  return dw;
}

struct Norm {
  Vec y, rstd;
};

Norm rmsnorm(const Vec& x, const Vec& g, I rows, I h) {
  Norm n{Vec(x.size()), Vec(static_cast<std::size_t>(rows))};
  for (I t = 0; t < rows; ++t) {
    double ss = 0.0;
    for (I i = 0; i < h; ++i)
      ss += x[static_cast<std::size_t>(t * h + i)] * x[static_cast<std::size_t>(t * h + i)];
    const double r = 1.0 / std::sqrt(ss / double(h) + kNormEps);
    n.rstd[static_cast<std::size_t>(t)] = r;
    for (I i = 0; i < h; ++i)
      n.y[static_cast<std::size_t>(t * h + i)] =
          x[static_cast<std::size_t>(t * h + i)] * r * g[static_cast<std::size_t>(i)];
  }
  return n;
}

// Accumulates dg and returns dx for y = x·r·g with r = (mean(x²) + eps)^(-1/2):
// dx_i = r·g_i·dy_i − x_i · r³/H · Σ_j dy_j g_j x_j.
Vec rmsnorm_back(const Vec& dy, const Vec& x, const Vec& g, const Vec& rstd, I rows, I h, Vec& dg) {
  Vec dx(x.size());
  for (I t = 0; t < rows; ++t) {
    const double r = rstd[static_cast<std::size_t>(t)];
    double dot = 0.0;
    for (I i = 0; i < h; ++i) {
      const auto k = static_cast<std::size_t>(t * h + i);
      dot += dy[k] * g[static_cast<std::size_t>(i)] * x[k];
      dg[static_cast<std::size_t>(i)] += dy[k] * x[k] * r;
    }
    for (I i = 0; i < h; ++i) {
      const auto k = static_cast<std::size_t>(t * h + i);
      dx[k] = r * g[static_cast<std::size_t>(i)] * dy[k] - x[k] * r * r * r / double(h) * dot;
    }
  }
  return dx;
}

// What a layer's forward keeps for its backward.
struct Layer {
  Vec x, rstd1, h, q, k, v, p, a, x2, rstd2, h2, gt, up, s;
  std::vector<HostVector<double>> moe_x;  // a MoE layer's h2 in sequence order, per routing group
  std::vector<MoeForward<double>> moe;    // per routing group
};

// A MoE layer's parameters, their balancing bias and (after backward) their gradients.
struct RefMoe {
  MoeWeights<double> w;
  Vec bias;
  MoeGrads<double> g;
};

using Params = std::array<Vec, kNumParams>;

const Vec& param(const Params& params, Param p) {
  return params[static_cast<std::size_t>(p)];
}
Vec& param(Params& params, Param p) {
  return params[static_cast<std::size_t>(p)];
}

// y += x, element by element.
void add_into(Vec& y, const Vec& x) {
  for (std::size_t i = 0; i < y.size(); ++i) y[i] += x[i];
}

double silu(double z) {
  return z / (1.0 + std::exp(-z));
}

class RefBlock {
 public:
  explicit RefBlock(const BlockConfig& c)
      : S(c.seq),
        B(c.batch),
        H(c.hidden),
        NH(c.heads),
        NKV(c.kv_heads_or_heads()),
        D(c.hidden / c.heads),
        KV(NKV * D),
        F(c.ffn),
        T(S * B),
        theta(c.rope_theta),
        moe_shape(c.moe.shape(c.hidden, c.seq * c.batch / c.moe.microbatches)),
        moe_groups(routing_groups(c)),
        seed(c.seed) {}
  /// `quantized` false: a layer the emulated stage keeps out of its recipe
  /// (LowpEmulation::keep_last), its GEMMs on the stored operands.
  RefBlock(const BlockConfig& c, const std::optional<LowpEmulation>& emulate, bool quantized = true)
      : RefBlock(c) {
    emul = emulate;
    quantize = quantized;
  }

  // Returns out; fills the saved layer state. `moe`: the layer's experts, or null (dense).
  Vec forward(const Params& w, const Vec& x, Layer& saved, const RefMoe* moe = nullptr) const {
    saved.x = stored(x);
    const Vec o = attention_forward(w, saved);
    saved.x2 = saved.x;
    add_into(saved.x2, o);
    saved.x2 = stored(saved.x2);
    return moe ? moe_forward_half(w, *moe, saved) : mlp_forward(w, saved);
  }

  // Returns dx; writes every weight gradient into dw (and a MoE layer's into moe->g). `call0`:
  // the number of the layer's first linear backward in the run (lowp::gradient_call), for nvfp4's
  // stochastic rounding.
  Vec backward(const Params& w, const Layer& saved, const Vec& dout_given, Params& dw,
               RefMoe* moe = nullptr, I call0 = 0) const {
    const Vec dout = stored(dout_given);
    Vec dx2 =
        moe ? moe_backward_half(w, *moe, saved, dout, dw) : mlp_backward(w, saved, dout, dw, call0);
    add_into(dx2, dout);
    dx2 = stored(dx2);
    Vec dx = attention_backward(w, saved, dx2, dw, call0 + 2);
    add_into(dx, dx2);
    return stored(dx);
  }

 private:
  // The linear layers' GEMMs: plain double, or under the emulated recipe (LowpEmulation). A
  // column-parallel layer's output columns and a row-parallel layer's input rows are sharded
  // over the group.
  static constexpr bool kColumn = false, kRow = true;

  // The operand m [rows, cols] under the recipe (lowp::emulate), K along its columns or rows;
  // `draw`: a gradient's stochastic rounding (m's rows its tokens, from 0).
  Vec q(const Vec& m, I rows, I cols, bool k_rows, lowp::Operand operand, I parts = 1,
        const lowp::StochasticRounding* draw = nullptr) const {
    return lowp::emulate(m, rows, cols, k_rows, emul->recipe, operand, parts, draw);
  }
  // A gradient's stochastic rounding under nvfp4 (LowpEmulation::stochastic): the stream of
  // operand j of pass `pass` (0 input gradient, 1 weight gradient) of linear backward `call`
  // (lowp::gradient_stream); nothing otherwise.
  std::optional<lowp::StochasticRounding> draw(I call, int pass, I j) const {
    if (!emul || emul->recipe != lowp::Recipe::nvfp4 || !emul->stochastic) return std::nullopt;
    return lowp::StochasticRounding{.stream = lowp::gradient_stream(seed, call, pass, j)};
  }
  // The parts a rank's shard cuts a sharded K into: rowwise's rows (see LowpEmulation).
  I k_parts(bool k_sharded) const {
    return k_sharded && emul->recipe == lowp::Recipe::rowwise ? I(emul->ranks) : 1;
  }

  // An activation or its gradient as the stage stores it: rounded to bf16 under
  // LowpEmulation::bf16_tokens (wherever the stage's block writes a tensor), else as it is. Every
  // operand the GEMMs below receive has been stored so already.
  Vec stored(const Vec& m) const { return emul && emul->bf16_tokens ? bf16_rounded(m) : m; }

  // A token operand m [T, cols], K along its columns, under the recipe. nvfp4's tensor scale is
  // the amax of the tensor a replica's TP group holds: each data-parallel replica's tokens are
  // quantized apart (their blocks lie inside a token row either way).
  Vec q_tokens(const Vec& m, I cols, lowp::Operand operand, I parts,
               const std::optional<lowp::StochasticRounding>& draws = std::nullopt) const {
    const lowp::StochasticRounding* sr = draws ? &*draws : nullptr;
    if (emul->recipe != lowp::Recipe::nvfp4 || emul->replicas == 1)
      return q(m, T, cols, false, operand, parts, sr);
    const I b = B / emul->replicas;
    Vec out(m.size());
    for (I d = 0; d < emul->replicas; ++d) {  // each replica's tokens numbered from 0
      const Vec part = q(replica_rows(m, cols, d), S * b, cols, false, operand, parts, sr);
      for (I s = 0; s < S; ++s)
        std::copy_n(part.begin() + static_cast<std::ptrdiff_t>(s * b * cols), b * cols,
                    out.begin() + static_cast<std::ptrdiff_t>((s * B + d * b) * cols));
    }
    return out;
  }

  // y = x·W, x [T, in], W [in, out]: K = in, sharded in a row layer.
  // A kept layer's weight as its bf16 GEMM reads it (the tokens are stored already).
  Vec kept_weight(const Vec& w) const { return emul->bf16_tokens ? bf16_rounded(w) : w; }

  Vec gemm(const Vec& x, const Vec& w, I in, I out, bool row) const {
    if (!emul) return matmul(x, w, T, in, out);
    if (!quantize) return matmul(x, kept_weight(w), T, in, out);
    using lowp::Operand;
    const I parts = k_parts(row);
    return matmul(q_tokens(x, in, Operand::activation, parts),
                  q(w, in, out, true, Operand::weight, parts), T, in, out);
  }
  // dx = dy·Wᵀ: K = out, sharded in a column layer. `call`, `j`: the gradient's draws (draw()).
  Vec gemm_dx(const Vec& dy, const Vec& w, I in, I out, bool row, I call = 0, I j = 0) const {
    if (!emul) return matmul_dx(dy, w, T, in, out);
    if (!quantize) return matmul_dx(dy, kept_weight(w), T, in, out);
    using lowp::Operand;
    const I parts = k_parts(!row);
    return matmul_dx(q_tokens(dy, out, Operand::gradient, parts, draw(call, 0, j)),
                     q(w, in, out, false, Operand::weight, parts), T, in, out);
  }
  // dW = xᵀ·dy: K = the tokens, whole on every rank. Under tensorwise both operands are the
  // codes of the forward's and the input gradient's GEMMs (one scale per tensor, any
  // orientation). Under the other recipes the stage quantizes each operand along the tokens
  // from what it holds: a column layer's input is the gathered FP8 shard of the forward
  // (quantized along H) and its gradient the fp32 one; a row layer's input is its fp32 shard and
  // its gradient the gathered FP8 one of the input-gradient GEMM (quantized along H).
  Vec gemm_dw(const Vec& x, const Vec& dy, I in, I out, bool row, I call = 0, I j = 0) const {
    if (!emul || !quantize) return matmul_dw(x, dy, T, in, out);
    using lowp::Operand;
    if (emul->recipe == lowp::Recipe::tensorwise)
      return matmul_dw(q(x, T, in, false, Operand::activation),
                       q(dy, T, out, false, Operand::gradient), T, in, out);
    const Vec xs = row ? x : q_tokens(x, in, Operand::activation, 1);
    const Vec dys = row ? q_tokens(dy, out, Operand::gradient, 1, draw(call, 0, j)) : dy;
    // Each data-parallel replica's tokens along the reduction, quantized apart; the sum of
    // the replicas' products.
    const I replicas = emul->replicas, tokens = T / replicas;
    Vec dw(static_cast<std::size_t>(in * out), 0.0);
    const bool rht = emul->recipe == lowp::Recipe::nvfp4 && emul->hadamard;
    for (I d = 0; d < replicas; ++d) {
      Vec xr = replica_rows(xs, in, d), dyr = replica_rows(dys, out, d);
      if (rht) {  // nvfp4: both operands through the random Hadamard transform along the tokens
        lowp::hadamard_rows(xr, tokens, in);
        lowp::hadamard_rows(dyr, tokens, out);
      }
      const auto sr = draw(call, 1, j);
      const Vec part = matmul_dw(
          q(xr, tokens, in, true, Operand::activation),
          q(dyr, tokens, out, true, Operand::gradient, 1, sr ? &*sr : nullptr), tokens, in, out);
      add_into(dw, part);
    }
    return dw;
  }
  // Replica d's rows of m [S, B, cols]: batch columns [d·B/D, (d+1)·B/D) of every position, in
  // their [S, B/D] order (all of m when D = 1).
  Vec replica_rows(const Vec& m, I cols, I d) const {
    const I b = B / emul->replicas;
    if (b == B) return m;
    Vec out;
    out.reserve(static_cast<std::size_t>(S * b * cols));
    for (I s = 0; s < S; ++s) {
      const auto first = m.begin() + static_cast<std::ptrdiff_t>((s * B + d * b) * cols);
      out.insert(out.end(), first, first + static_cast<std::ptrdiff_t>(b * cols));
    }
    return out;
  }

  // norm1, Q/K/V with RoPE, causal attention; returns a·Wo (the residual is the caller's).
  Vec attention_forward(const Params& w, Layer& saved) const {
    Norm n1 = rmsnorm(saved.x, param(w, Param::norm1), T, H);
    saved.h = stored(n1.y);
    saved.rstd1 = n1.rstd;
    saved.q = stored(gemm(saved.h, param(w, Param::wq), H, H, kColumn));
    saved.k = stored(gemm(saved.h, param(w, Param::wk), H, KV, kColumn));
    saved.v = stored(gemm(saved.h, param(w, Param::wv), H, KV, kColumn));
    rope(saved.q, NH, +1.0);
    rope(saved.k, NKV, +1.0);
    saved.q = stored(saved.q);
    saved.k = stored(saved.k);
    causal_softmax_attention(saved);
    saved.a = stored(saved.a);
    return stored(gemm(saved.a, param(w, Param::wo), H, H, kRow));
  }

  // saved.p = softmax(q·kᵀ/√D) under the causal mask, saved.a = p·v, every head.
  void causal_softmax_attention(Layer& saved) const {
    saved.p.assign(static_cast<std::size_t>(B * NH * S * S), 0.0);
    saved.a.assign(static_cast<std::size_t>(T * H), 0.0);
    const double scale = 1.0 / std::sqrt(double(D));
    for (I b = 0; b < B; ++b)
      for (I hd = 0; hd < NH; ++hd)
        for (I i = 0; i < S; ++i) {
          double* prow = &saved.p[static_cast<std::size_t>(((b * NH + hd) * S + i) * S)];
          double mx = -INFINITY;
          for (I j = 0; j <= i; ++j) {
            double dot = 0.0;
            for (I d = 0; d < D; ++d) dot += saved.q[at(i, b, hd, d)] * saved.k[kv_at(j, b, hd, d)];
            prow[j] = dot * scale;
            mx = std::max(mx, prow[j]);
          }
          double sum = 0.0;
          for (I j = 0; j <= i; ++j) sum += (prow[j] = std::exp(prow[j] - mx));
          for (I j = 0; j <= i; ++j) prow[j] /= sum;
          for (I j = 0; j <= i; ++j)
            for (I d = 0; d < D; ++d)
              saved.a[at(i, b, hd, d)] += prow[j] * saved.v[kv_at(j, b, hd, d)];
        }
  }

  // norm2 and the SwiGLU MLP on saved.x2; returns x2 + its output.
  Vec mlp_forward(const Params& w, Layer& saved) const {
    Norm n2 = rmsnorm(saved.x2, param(w, Param::norm2), T, H);
    saved.h2 = stored(n2.y);
    saved.rstd2 = n2.rstd;
    saved.gt = stored(gemm(saved.h2, param(w, Param::w_gate), H, F, kColumn));
    saved.up = stored(gemm(saved.h2, param(w, Param::w_up), H, F, kColumn));
    saved.s.resize(saved.gt.size());
    for (std::size_t i = 0; i < saved.s.size(); ++i) saved.s[i] = silu(saved.gt[i]) * saved.up[i];
    saved.s = stored(saved.s);
    Vec m = stored(gemm(saved.s, param(w, Param::w_down), F, H, kRow));
    Vec out = saved.x2;
    add_into(out, m);
    return stored(out);
  }

  // The MLP half's backward: the gradients of Wd, Wg, Wu and norm2; returns the gradient that
  // reaches x2 through norm2 (the residual's dout is the caller's).
  // `call`: the number of its first linear backward (down; gate/up is call + 1).
  Vec mlp_backward(const Params& w, const Layer& saved, const Vec& dout, Params& dw, I call) const {
    param(dw, Param::w_down) = gemm_dw(saved.s, dout, F, H, kRow, call);
    const Vec ds = stored(gemm_dx(dout, param(w, Param::w_down), F, H, kRow, call));
    Vec dgt(ds.size()), dup(ds.size());
    for (std::size_t i = 0; i < ds.size(); ++i) {
      const double z = saved.gt[i], sg = 1.0 / (1.0 + std::exp(-z));
      dup[i] = ds[i] * silu(z);
      dgt[i] = ds[i] * saved.up[i] * sg * (1.0 + z * (1.0 - sg));
    }
    param(dw, Param::w_gate) = gemm_dw(saved.h2, dgt, H, F, kColumn, call + 1, 0);
    param(dw, Param::w_up) = gemm_dw(saved.h2, dup, H, F, kColumn, call + 1, 1);
    dgt = stored(dgt);
    dup = stored(dup);
    Vec dh2 = gemm_dx(dgt, param(w, Param::w_gate), H, F, kColumn, call + 1, 0);
    add_into(dh2, gemm_dx(dup, param(w, Param::w_up), H, F, kColumn, call + 1, 1));
    dh2 = stored(dh2);
    param(dw, Param::norm2).assign(static_cast<std::size_t>(H), 0.0);
    return stored(rmsnorm_back(dh2, saved.x2, param(w, Param::norm2), saved.rstd2, T, H,
                               param(dw, Param::norm2)));
  }

  // The sequences of each routing group (MoeConfig::group_of), in ascending order: all B in one
  // group unless a pipeline's micro-batches cut the step.
  static std::vector<std::vector<I>> routing_groups(const BlockConfig& c) {
    std::vector<std::vector<I>> groups(static_cast<std::size_t>(c.moe.microbatches));
    for (I b = 0; b < c.batch; ++b)
      groups[static_cast<std::size_t>(c.moe.group_of(b, c.batch))].push_back(b);
    return groups;
  }

  // The rows [S, H] of `seqs` out of sequence-major rows [B, S, H], and back into them.
  HostVector<double> group_rows(const HostVector<double>& all, const std::vector<I>& seqs) const {
    HostVector<double> out;
    out.reserve(seqs.size() * static_cast<std::size_t>(S * H));
    for (const I b : seqs)
      out.insert(out.end(), all.begin() + b * S * H, all.begin() + (b + 1) * S * H);
    return out;
  }
  void put_group_rows(HostVector<double>& all, const std::vector<I>& seqs,
                      const HostVector<double>& rows) const {
    for (std::size_t i = 0; i < seqs.size(); ++i)
      std::copy_n(rows.begin() + static_cast<I>(i) * S * H, S * H, all.begin() + seqs[i] * S * H);
  }

  // Stage 10's MLP half: norm2, then the mixture of experts over each routing group's tokens in
  // sequence order (common/moe_model.h); returns x2 + its output.
  Vec moe_forward_half(const Params& w, const RefMoe& moe, Layer& saved) const {
    Norm n2 = rmsnorm(saved.x2, param(w, Param::norm2), T, H);
    saved.h2 = n2.y;
    saved.rstd2 = n2.rstd;
    const HostVector<double> x = to_sequence_major(saved.h2.data(), S, B, H);
    HostVector<double> y(x.size());
    saved.moe_x.clear();
    saved.moe.clear();
    for (const std::vector<I>& seqs : moe_groups) {
      saved.moe_x.push_back(group_rows(x, seqs));
      saved.moe.push_back(moe_forward<double>(moe_shape, moe.w, saved.moe_x.back(), moe.bias));
      put_group_rows(y, seqs, saved.moe.back().y);
    }
    const HostVector<double> y_tokens = from_sequence_major(y.data(), S, B, H);
    Vec out(y_tokens.begin(), y_tokens.end());
    add_into(out, saved.x2);
    return out;
  }

  // Its backward: the experts' gradients (the auxiliary loss's included) summed over the
  // routing groups into moe.g, norm2's into dw; the layer has no dense w_gate, w_up, w_down
  // (their entries stay empty).
  Vec moe_backward_half(const Params& w, RefMoe& moe, const Layer& saved, const Vec& dout,
                        Params& dw) const {
    const HostVector<double> dy = to_sequence_major(dout.data(), S, B, H);
    HostVector<double> dx_rows(dy.size());
    for (std::size_t j = 0; j < moe_groups.size(); ++j) {
      MoeGrads<double> g = moe_backward<double>(moe_shape, moe.w, saved.moe_x[j], saved.moe[j],
                                                group_rows(dy, moe_groups[j]));
      put_group_rows(dx_rows, moe_groups[j], g.x);
      if (j == 0) {
        moe.g = std::move(g);
        continue;
      }
      const auto into = moe_tensors(moe.g.w);
      const auto from = moe_tensors(g.w);
      for (std::size_t p = 0; p < into.size(); ++p)
        std::transform(into[p]->begin(), into[p]->end(), from[p]->begin(), into[p]->begin(),
                       std::plus<>());
    }
    const HostVector<double> dx = from_sequence_major(dx_rows.data(), S, B, H);
    const Vec dh2(dx.begin(), dx.end());
    param(dw, Param::norm2).assign(static_cast<std::size_t>(H), 0.0);
    return rmsnorm_back(dh2, saved.x2, param(w, Param::norm2), saved.rstd2, T, H,
                        param(dw, Param::norm2));
  }

  // The attention half's backward from dx2: the gradients of Wo, Wq, Wk, Wv and norm1; returns
  // the gradient that reaches x through norm1 (the residual's dx2 is the caller's).
  // `call`: the number of its first linear backward (o; qkv is call + 1).
  Vec attention_backward(const Params& w, const Layer& saved, const Vec& dx2, Params& dw,
                         I call) const {
    param(dw, Param::wo) = gemm_dw(saved.a, dx2, H, H, kRow, call);
    const Vec da = stored(gemm_dx(dx2, param(w, Param::wo), H, H, kRow, call));
    Vec dq(da.size(), 0.0), dk(saved.k.size(), 0.0), dv(saved.v.size(), 0.0);
    causal_softmax_attention_backward(saved, da, dq, dk, dv);
    dq = stored(dq);
    dk = stored(dk);
    dv = stored(dv);
    rope(dq, NH, -1.0);  // the rotation's transpose
    rope(dk, NKV, -1.0);
    dq = stored(dq);
    dk = stored(dk);
    param(dw, Param::wq) = gemm_dw(saved.h, dq, H, H, kColumn, call + 1, 0);
    param(dw, Param::wk) = gemm_dw(saved.h, dk, H, KV, kColumn, call + 1, 1);
    param(dw, Param::wv) = gemm_dw(saved.h, dv, H, KV, kColumn, call + 1, 2);
    Vec dh = gemm_dx(dq, param(w, Param::wq), H, H, kColumn, call + 1, 0);
    add_into(dh, gemm_dx(dk, param(w, Param::wk), H, KV, kColumn, call + 1, 1));
    add_into(dh, gemm_dx(dv, param(w, Param::wv), H, KV, kColumn, call + 1, 2));
    dh = stored(dh);
    param(dw, Param::norm1).assign(static_cast<std::size_t>(H), 0.0);
    return stored(rmsnorm_back(dh, saved.x, param(w, Param::norm1), saved.rstd1, T, H,
                               param(dw, Param::norm1)));
  }

  // From da (the gradient of p·v): dq, dk and dv (zeroed by the caller; a KV head sums over its
  // group of query heads), before the rotary embedding's transpose.
  void causal_softmax_attention_backward(const Layer& saved, const Vec& da, Vec& dq, Vec& dk,
                                         Vec& dv) const {
    const double scale = 1.0 / std::sqrt(double(D));
    std::vector<double> dp(static_cast<std::size_t>(S));
    for (I b = 0; b < B; ++b)
      for (I hd = 0; hd < NH; ++hd)
        for (I i = 0; i < S; ++i) {
          const double* prow = &saved.p[static_cast<std::size_t>(((b * NH + hd) * S + i) * S)];
          double dot = 0.0;
          for (I j = 0; j <= i; ++j) {
            double acc = 0.0;
            for (I d = 0; d < D; ++d) {
              acc += da[at(i, b, hd, d)] * saved.v[kv_at(j, b, hd, d)];
              dv[kv_at(j, b, hd, d)] += prow[j] * da[at(i, b, hd, d)];  // Σ over the group
            }
            dp[static_cast<std::size_t>(j)] = acc;
            dot += acc * prow[j];
          }
          for (I j = 0; j <= i; ++j) {
            const double dsc = prow[j] * (dp[static_cast<std::size_t>(j)] - dot) * scale;
            for (I d = 0; d < D; ++d) {
              dq[at(i, b, hd, d)] += dsc * saved.k[kv_at(j, b, hd, d)];
              dk[kv_at(j, b, hd, d)] += dsc * saved.q[at(i, b, hd, d)];
            }
          }
        }
  }

  // Index of element (position s, batch b, head h, dim d) in a [S, B, H] tensor.
  std::size_t at(I s, I b, I h, I d) const {
    return static_cast<std::size_t>((s * B + b) * H + h * D + d);
  }
  // The element of k or v [S, B, NKV·D] that query head h reads: its group's KV head.
  std::size_t kv_at(I s, I b, I h, I d) const {
    return static_cast<std::size_t>((s * B + b) * KV + (h / (NH / NKV)) * D + d);
  }

  // Rotary embedding of x [S, B, heads·D] in place, by +angle (sign 1) or −angle (−1): pair
  // (i, i + D/2) of every head at position s turns by s·θ^(−2i/D), all in double.
  void rope(Vec& x, I heads, double sign) const {
    if (!(theta > 0)) return;
    for (I s = 0; s < S; ++s)
      for (I i = 0; i < D / 2; ++i) {
        const double angle = double(s) * std::pow(theta, -2.0 * double(i) / double(D));
        const double cs = std::cos(angle), sn = sign * std::sin(angle);
        for (I r = 0; r < B * heads; ++r) {
          double& x1 = x[static_cast<std::size_t>((s * B * heads + r) * D + i)];
          double& x2 = x[static_cast<std::size_t>((s * B * heads + r) * D + i + D / 2)];
          const double a = x1, b = x2;
          x1 = a * cs - b * sn;
          x2 = b * cs + a * sn;
        }
      }
  }

  I S, B, H, NH, NKV, D, KV, F, T;
  double theta;
  MoeShape moe_shape;                      // stage 10's MoE layers, over one routing group
  std::vector<std::vector<I>> moe_groups;  // each routing group's sequences
  std::uint64_t seed;                      // the run's, for nvfp4's stochastic rounding
  std::optional<LowpEmulation> emul;
  bool quantize = true;  // false: every GEMM unquantized (a layer kept out of the recipe)
};

// The loss ½·mean((y − target)²) and its gradient dy = (y − target)/n.
double mse_loss(const Vec& y, const Vec& target, Vec& dy) {
  const double elements = double(y.size());
  double sum = 0.0;
  dy.resize(y.size());
  for (std::size_t i = 0; i < y.size(); ++i) {
    sum += (y[i] - target[i]) * (y[i] - target[i]);
    dy[i] = (y[i] - target[i]) / elements;
  }
  return 0.5 * sum / elements;
}

// The language model's two ends (DESIGN.md, "The language model around the block"), on the
// step's tokens: x[t] = E[token t]; after the blocks, the final norm, logits z = h·W_out and the
// mean over positions of logsumexp(z) − z[target], with its gradient (softmax − onehot) / T.
// With `bf16` (a low-precision emulation of a stage that keeps its activations in bf16,
// LowpEmulation::bf16_tokens) the output layer is the stage's bf16 GEMM: h and W_out rounded to
// bf16, the logits, their gradient and dh stored in bf16, the products in double.
struct RefLm {
  I T, H, V;
  // What backward needs.
  Vec y, h, rstd;
  std::vector<std::int32_t> tokens, targets;
  bool bf16 = false;

  Vec as_stored(const Vec& m) const { return bf16 ? bf16_rounded(m) : m; }

  Vec embed(const Vec& e) const {
    Vec x(static_cast<std::size_t>(T * H));
    for (I t = 0; t < T; ++t)
      for (I i = 0; i < H; ++i)
        x[static_cast<std::size_t>(t * H + i)] =
            e[static_cast<std::size_t>(I(tokens[std::size_t(t)]) * H + i)];
    return x;
  }
  // The loss, and dy for the last block; the final gain's and the output layer's gradients.
  double head(const std::array<Vec, kLmParams>& p, const Vec& out, Vec& dy,
              std::array<Vec, kLmParams>& g) {
    y = out;
    Norm n = rmsnorm(y, p[1], T, H);
    h = as_stored(n.y);
    rstd = n.rstd;
    const Vec w_out = as_stored(p[2]);
    const Vec z = as_stored(matmul(h, w_out, T, H, V));
    Vec dz(z.size());
    double loss = 0.0;
    for (I t = 0; t < T; ++t) {
      const double* zt = z.data() + t * V;
      const double m = *std::max_element(zt, zt + V);
      double sum = 0.0;
      for (I j = 0; j < V; ++j) sum += std::exp(zt[j] - m);
      const double lse = m + std::log(sum);
      const I target = targets[std::size_t(t)];
      loss += lse - zt[target];
      for (I j = 0; j < V; ++j)
        dz[std::size_t(t * V + j)] =
            (std::exp(zt[j] - lse) - (j == target ? 1.0 : 0.0)) / double(T);
    }
    dz = as_stored(dz);
    g[2] = matmul_dw(h, dz, T, H, V);
    const Vec dh = as_stored(matmul_dx(dz, w_out, T, H, V));
    g[1].assign(static_cast<std::size_t>(H), 0.0);
    dy = rmsnorm_back(dh, y, p[1], rstd, T, H, g[1]);
    return loss / double(T);
  }
  // The embedding's gradient: each position's dx added to its token's row.
  Vec embed_back(const Vec& dx) const {
    Vec de(static_cast<std::size_t>(V * H), 0.0);
    for (I t = 0; t < T; ++t)
      for (I i = 0; i < H; ++i)
        de[static_cast<std::size_t>(I(tokens[std::size_t(t)]) * H + i)] +=
            dx[static_cast<std::size_t>(t * H + i)];
    return de;
  }
};

void sgd_update(const BlockConfig& c, const std::vector<Params>& grads,
                std::vector<Params>& params) {
  for (std::size_t l = 0; l < params.size(); ++l)
    for (std::size_t p = 0; p < kNumParams; ++p)
      for (std::size_t i = 0; i < grads[l][p].size(); ++i)  // none: a MoE layer's dense MLP
        params[l][p][i] -= c.lr * grads[l][p][i];
}

// AdamW's two moments, zero before the first update.
struct AdamState {
  std::vector<Params> moment1, moment2;
  std::array<Vec, kLmParams> lm1, lm2;  // the language model's
};

// One tensor after step t = step + 1: SGD (w −= lr·g), or AdamW (torch.optim.AdamW): the moments
// m1, m2, the decoupled decay where `decay`, the bias-corrected update. Only g's elements move: a
// MoE layer's dense MLP has no gradient (the experts replace it) and keeps its weights.
void update_tensor(const BlockConfig& c, int step, std::span<double> w, std::span<const double> g,
                   std::span<double> m1, std::span<double> m2, bool decay) {
  if (c.optimizer == Optimizer::sgd) {
    for (std::size_t i = 0; i < g.size(); ++i) w[i] -= c.lr * g[i];
    return;
  }
  const double t = double(step + 1);
  const double bias1 = 1.0 - std::pow(c.beta1, t), bias2 = 1.0 - std::pow(c.beta2, t);
  for (std::size_t i = 0; i < g.size(); ++i) {
    m1[i] = c.beta1 * m1[i] + (1.0 - c.beta1) * g[i];
    m2[i] = c.beta2 * m2[i] + (1.0 - c.beta2) * g[i] * g[i];
    if (decay) w[i] -= c.lr * c.weight_decay * w[i];
    w[i] -= c.lr * (m1[i] / bias1) / (std::sqrt(m2[i] / bias2) + c.eps);
  }
}

// The blocks under AdamW: decay on everything but the norm gains.
void adamw_update(const BlockConfig& c, int step, const std::vector<Params>& grads,
                  std::vector<Params>& params, AdamState& adam) {
  if (adam.moment1.empty()) {
    adam.moment1 = params;
    adam.moment2 = params;
    for (auto* moments : {&adam.moment1, &adam.moment2})
      for (auto& layer : *moments)
        for (auto& v : layer) std::fill(v.begin(), v.end(), 0.0);
  }
  for (std::size_t l = 0; l < params.size(); ++l)
    for (std::size_t p = 0; p < kNumParams; ++p)  // (a MoE layer's dense MLP: empty)
      update_tensor(c, step, params[l][p], grads[l][p], adam.moment1[l][p], adam.moment2[l][p],
                    param_split(kAllParams[p]) != Split::replicated);
}

// The language model's three parameters: SGD, or AdamW with decay on the embedding and the
// output layer (not on the final gain), moments kept beside the blocks'.
void update_lm(const BlockConfig& c, int step, const std::array<Vec, kLmParams>& grads,
               std::array<Vec, kLmParams>& params, AdamState& adam) {
  if (adam.lm1[0].empty())
    for (std::size_t i = 0; i < params.size(); ++i) {
      adam.lm1[i].assign(params[i].size(), 0.0);
      adam.lm2[i].assign(params[i].size(), 0.0);
    }
  for (std::size_t p = 0; p < params.size(); ++p)
    update_tensor(c, step, params[p], grads[p], adam.lm1[p], adam.lm2[p],
                  kLmSplits[p] != Split::replicated);
}

// A MoE layer's tensors after a step: SGD or AdamW (every one a matrix: decayed), their moments
// in `moments` (made on the first call), then the balancing bias moved from the step's counts
// over all tokens (moe_update_bias; not a gradient).
void update_moe(const BlockConfig& c, int step, RefMoe& moe,
                const std::vector<MoeForward<double>>& groups, std::vector<Vec>& moments) {
  const auto w = moe_tensors(moe.w);
  const auto g = moe_tensors(moe.g.w);
  if (moments.empty())
    for (const HostVector<double>* t : w) moments.insert(moments.end(), 2, Vec(t->size(), 0.0));
  for (std::size_t p = 0; p < w.size(); ++p)
    update_tensor(c, step, *w[p], *g[p], moments[2 * p], moments[2 * p + 1], true);
  if (c.moe.bias_rate > 0) {
    std::vector<std::int64_t> counts(static_cast<std::size_t>(c.moe.experts), 0);
    for (const MoeForward<double>& f : groups)
      for (std::size_t e = 0; e < counts.size(); ++e) counts[e] += f.routing.routed_per_expert[e];
    moe_update_bias<double>(moe.bias, counts, c.moe.bias_rate);
  }
}

}  // namespace

ReferenceState reference_init(const BlockConfig& c) {
  const I n = c.seq * c.batch * c.hidden;
  ReferenceState s;
  if (c.lm()) {
    s.lm[0] = normal(c, TensorId::embedding, c.vocab * c.hidden, 0.0, 0.02);
    s.lm[1].assign(static_cast<std::size_t>(c.hidden), 1.0);
    s.lm[2] = normal(c, TensorId::w_out, c.hidden * c.vocab, 0.0, 0.02);
  } else {
    s.input = normal(c, TensorId::input, n, 0.0, 1.0);
    s.target = normal(c, TensorId::target, n, 0.0, 1.0);
  }
  s.params.resize(static_cast<std::size_t>(c.layers));
  for (I l = 0; l < c.layers; ++l)
    for (Param p : kAllParams) {
      const auto shape = param_shape(p, c);
      const I count = shape.size() == 1 ? shape[0] : shape[0] * shape[1];
      const bool gain = param_split(p) == Split::replicated;
      s.params[static_cast<std::size_t>(l)][static_cast<std::size_t>(p)] = normal(
          c, TensorId::layer(l, static_cast<int>(p)), count, gain ? 1.0 : 0.0, gain ? 0.0 : 0.02);
    }
  return s;
}

ReferenceRun reference_run(const BlockConfig& c, int steps) {
  return reference_run_from(c, reference_init(c), steps);
}

ReferenceRun reference_run_lowp(const BlockConfig& c, int steps, const LowpEmulation& lowp) {
  return reference_run_from(c, reference_init(c), steps, lowp);
}

ReferenceRun reference_run_from(const BlockConfig& c, ReferenceState state, int steps,
                                const std::optional<LowpEmulation>& lowp) {
  auto& params = state.params;
  const RefBlock quantized(c, lowp), kept(c, lowp, /*quantized=*/false);
  // The blocks the recipe runs on: all but the last keep_last.
  const auto block_of = [&](std::size_t l) -> const RefBlock& {
    return lowp && I(l) >= c.layers - lowp->keep_last ? kept : quantized;
  };
  ReferenceRun run;
  std::vector<Layer> saved(static_cast<std::size_t>(c.layers));
  AdamState adam;
  // The language model's ends as one more "layer" of three parameters for the optimizer.
  RefLm lm{c.seq * c.batch, c.hidden, c.vocab, {}, {}, {}, {}, {}, lowp && lowp->bf16_tokens};
  const std::optional<TokenStream> stream =
      c.lm() ? std::optional<TokenStream>(std::in_place, c) : std::nullopt;
  // Stage 10's MoE layers: each one's experts, bias and AdamW moments.
  std::vector<std::optional<RefMoe>> moe(saved.size());
  std::vector<std::vector<Vec>> moe_moments(saved.size());
  for (std::size_t l = 0; l < moe.size(); ++l)
    if (c.moe.layer(I(l)))
      moe[l] = RefMoe{.w = moe_init<double>(c, I(l), 0, c.moe.experts),
                      .bias = Vec(static_cast<std::size_t>(c.moe.experts), 0.0),
                      .g = {}};
  for (auto& layer : moe)
    if (layer) layer->bias[0] = double(float(c.moe.skew));  // as the stage's float bias starts
  auto moe_of = [&](std::size_t l) { return moe[l] ? &*moe[l] : nullptr; };
  for (int step = 0; step < steps; ++step) {
    Vec out;
    if (stream) {
      const TokenBatch batch = stream->batch(step);
      lm.tokens = batch.tokens;
      lm.targets = batch.targets;
      out = lm.embed(state.lm[0]);
    } else {
      out = state.input;
    }
    for (std::size_t l = 0; l < saved.size(); ++l)
      out = block_of(l).forward(params[l], out, saved[l], moe_of(l));
    Vec dout;
    std::array<Vec, kLmParams> lm_grads;
    double loss =
        stream ? lm.head(state.lm, out, dout, lm_grads) : mse_loss(out, state.target, dout);
    for (std::size_t l = 0; l < saved.size(); ++l)
      if (moe[l])
        for (const MoeForward<double>& f : saved[l].moe)
          loss += f.aux_loss;  // its gradient is moe_backward's own
    run.losses.push_back(loss);
    std::vector<Params> grads(saved.size());
    for (std::size_t l = saved.size(); l-- > 0;)
      dout = block_of(l).backward(params[l], saved[l], dout, grads[l], moe_of(l),
                                  lowp::gradient_call(c.layers, step, I(l)));
    if (stream) lm_grads[0] = lm.embed_back(dout);
    if (step == 0) {
      run.output = out;
      run.input_grad = dout;
      run.grads = grads;
      if (stream) run.lm_grads = lm_grads;
      for (std::size_t l = 0; l < moe.size(); ++l)
        if (moe[l])
          for (NamedArray<double>& named : moe_named(c.moe, moe[l]->g.w, I(l), 0))
            run.extra_grads.push_back(std::move(named));
    }
    if (c.optimizer == Optimizer::sgd)
      sgd_update(c, grads, params);
    else
      adamw_update(c, step, grads, params, adam);
    if (stream) update_lm(c, step, lm_grads, state.lm, adam);
    for (std::size_t l = 0; l < moe.size(); ++l)
      if (moe[l]) update_moe(c, step, *moe[l], saved[l].moe, moe_moments[l]);
  }
  return run;
}

}  // namespace tpx
