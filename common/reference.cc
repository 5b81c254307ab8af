// Plain loops in double. Matrices are row-major std::vector<double>; a "token" is one (s, b)
// position, token index t = s·B + b.
#include "reference.h"

#include <cmath>

#include "init.h"

namespace tpx {
namespace {

using Vec = std::vector<double>;
using I = std::int64_t;

Vec normal(const BlockConfig& c, std::uint64_t id, I n, double mean, double std) {
  Vec v(static_cast<std::size_t>(n));
  for (I i = 0; i < n; ++i)
    v[static_cast<std::size_t>(i)] =
        double(float(mean + std * normal_at(c.seed, id, std::uint64_t(i))));
  return v;
}

// Y[t, o] = Σ_i X[t, i] W[i, o]
Vec matmul(const Vec& x, const Vec& w, I rows, I in, I out) {
  Vec y(static_cast<std::size_t>(rows * out), 0.0);
  for (I t = 0; t < rows; ++t)
    for (I i = 0; i < in; ++i) {
      const double xv = x[static_cast<std::size_t>(t * in + i)];
      for (I o = 0; o < out; ++o)
        y[static_cast<std::size_t>(t * out + o)] += xv * w[static_cast<std::size_t>(i * out + o)];
    }
  return y;
}

// dX[t, i] = Σ_o dY[t, o] W[i, o]
Vec matmul_dx(const Vec& dy, const Vec& w, I rows, I in, I out) {
  Vec dx(static_cast<std::size_t>(rows * in), 0.0);
  for (I t = 0; t < rows; ++t)
    for (I i = 0; i < in; ++i) {
      double acc = 0.0;
      for (I o = 0; o < out; ++o)
        acc += dy[static_cast<std::size_t>(t * out + o)] * w[static_cast<std::size_t>(i * out + o)];
      dx[static_cast<std::size_t>(t * in + i)] = acc;
    }
  return dx;
}

// dW[i, o] = Σ_t X[t, i] dY[t, o]
Vec matmul_dw(const Vec& x, const Vec& dy, I rows, I in, I out) {
  Vec dw(static_cast<std::size_t>(in * out), 0.0);
  for (I t = 0; t < rows; ++t)
    for (I i = 0; i < in; ++i) {
      const double xv = x[static_cast<std::size_t>(t * in + i)];
      for (I o = 0; o < out; ++o)
        dw[static_cast<std::size_t>(i * out + o)] += xv * dy[static_cast<std::size_t>(t * out + o)];
    }
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

struct Layer {
  Vec x, rstd1, h, q, k, v, p, a, x2, rstd2, h2, gt, up, s;
};

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
        theta(c.rope_theta) {}

  // Returns out; fills the saved layer state.
  Vec forward(const std::array<Vec, kNumParams>& w, const Vec& x, Layer& L) const {
    L.x = x;
    Norm n1 = rmsnorm(x, w[0], T, H);
    L.h = n1.y;
    L.rstd1 = n1.rstd;
    L.q = matmul(L.h, w[1], T, H, H);
    L.k = matmul(L.h, w[2], T, H, KV);
    L.v = matmul(L.h, w[3], T, H, KV);
    rope(L.q, NH, +1.0);
    rope(L.k, NKV, +1.0);
    L.p.assign(static_cast<std::size_t>(B * NH * S * S), 0.0);
    L.a.assign(static_cast<std::size_t>(T * H), 0.0);
    const double scale = 1.0 / std::sqrt(double(D));
    for (I b = 0; b < B; ++b)
      for (I hd = 0; hd < NH; ++hd)
        for (I i = 0; i < S; ++i) {
          double* prow = &L.p[static_cast<std::size_t>(((b * NH + hd) * S + i) * S)];
          double mx = -INFINITY;
          for (I j = 0; j <= i; ++j) {
            double dot = 0.0;
            for (I d = 0; d < D; ++d) dot += L.q[at(i, b, hd, d)] * L.k[kv_at(j, b, hd, d)];
            prow[j] = dot * scale;
            mx = std::max(mx, prow[j]);
          }
          double sum = 0.0;
          for (I j = 0; j <= i; ++j) sum += (prow[j] = std::exp(prow[j] - mx));
          for (I j = 0; j <= i; ++j) prow[j] /= sum;
          for (I j = 0; j <= i; ++j)
            for (I d = 0; d < D; ++d) L.a[at(i, b, hd, d)] += prow[j] * L.v[kv_at(j, b, hd, d)];
        }
    Vec o = matmul(L.a, w[4], T, H, H);
    L.x2 = x;
    for (std::size_t i = 0; i < o.size(); ++i) L.x2[i] += o[i];
    Norm n2 = rmsnorm(L.x2, w[5], T, H);
    L.h2 = n2.y;
    L.rstd2 = n2.rstd;
    L.gt = matmul(L.h2, w[6], T, H, F);
    L.up = matmul(L.h2, w[7], T, H, F);
    L.s.resize(L.gt.size());
    for (std::size_t i = 0; i < L.s.size(); ++i) L.s[i] = silu(L.gt[i]) * L.up[i];
    Vec m = matmul(L.s, w[8], T, F, H);
    Vec out = L.x2;
    for (std::size_t i = 0; i < out.size(); ++i) out[i] += m[i];
    return out;
  }

  // Returns dx; writes every weight gradient into dw.
  Vec backward(const std::array<Vec, kNumParams>& w, const Layer& L, const Vec& dout,
               std::array<Vec, kNumParams>& dw) const {
    dw[8] = matmul_dw(L.s, dout, T, F, H);
    Vec ds = matmul_dx(dout, w[8], T, F, H);
    Vec dgt(ds.size()), dup(ds.size());
    for (std::size_t i = 0; i < ds.size(); ++i) {
      const double z = L.gt[i], sg = 1.0 / (1.0 + std::exp(-z));
      dup[i] = ds[i] * silu(z);
      dgt[i] = ds[i] * L.up[i] * sg * (1.0 + z * (1.0 - sg));
    }
    dw[6] = matmul_dw(L.h2, dgt, T, H, F);
    dw[7] = matmul_dw(L.h2, dup, T, H, F);
    Vec dh2 = matmul_dx(dgt, w[6], T, H, F);
    const Vec dh2u = matmul_dx(dup, w[7], T, H, F);
    for (std::size_t i = 0; i < dh2.size(); ++i) dh2[i] += dh2u[i];
    dw[5].assign(static_cast<std::size_t>(H), 0.0);
    Vec dx2 = rmsnorm_back(dh2, L.x2, w[5], L.rstd2, T, H, dw[5]);
    for (std::size_t i = 0; i < dx2.size(); ++i) dx2[i] += dout[i];

    dw[4] = matmul_dw(L.a, dx2, T, H, H);
    const Vec da = matmul_dx(dx2, w[4], T, H, H);
    Vec dq(da.size(), 0.0), dk(L.k.size(), 0.0), dv(L.v.size(), 0.0);
    const double scale = 1.0 / std::sqrt(double(D));
    std::vector<double> dp(static_cast<std::size_t>(S));
    for (I b = 0; b < B; ++b)
      for (I hd = 0; hd < NH; ++hd)
        for (I i = 0; i < S; ++i) {
          const double* prow = &L.p[static_cast<std::size_t>(((b * NH + hd) * S + i) * S)];
          double dot = 0.0;
          for (I j = 0; j <= i; ++j) {
            double acc = 0.0;
            for (I d = 0; d < D; ++d) {
              acc += da[at(i, b, hd, d)] * L.v[kv_at(j, b, hd, d)];
              dv[kv_at(j, b, hd, d)] += prow[j] * da[at(i, b, hd, d)];  // Σ over the group
            }
            dp[static_cast<std::size_t>(j)] = acc;
            dot += acc * prow[j];
          }
          for (I j = 0; j <= i; ++j) {
            const double dsc = prow[j] * (dp[static_cast<std::size_t>(j)] - dot) * scale;
            for (I d = 0; d < D; ++d) {
              dq[at(i, b, hd, d)] += dsc * L.k[kv_at(j, b, hd, d)];
              dk[kv_at(j, b, hd, d)] += dsc * L.q[at(i, b, hd, d)];
            }
          }
        }
    rope(dq, NH, -1.0);  // the rotation's transpose
    rope(dk, NKV, -1.0);
    dw[1] = matmul_dw(L.h, dq, T, H, H);
    dw[2] = matmul_dw(L.h, dk, T, H, KV);
    dw[3] = matmul_dw(L.h, dv, T, H, KV);
    Vec dh = matmul_dx(dq, w[1], T, H, H);
    for (const auto& [dy, wi] : {std::pair{&dk, &w[2]}, std::pair{&dv, &w[3]}}) {
      const Vec part = matmul_dx(*dy, *wi, T, H, KV);
      for (std::size_t i = 0; i < dh.size(); ++i) dh[i] += part[i];
    }
    dw[0].assign(static_cast<std::size_t>(H), 0.0);
    Vec dx = rmsnorm_back(dh, L.x, w[0], L.rstd1, T, H, dw[0]);
    for (std::size_t i = 0; i < dx.size(); ++i) dx[i] += dx2[i];
    return dx;
  }

 private:
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
};

}  // namespace

ReferenceState reference_init(const BlockConfig& c) {
  const I n = c.seq * c.batch * c.hidden;
  ReferenceState s;
  s.input = normal(c, TensorId::input, n, 0.0, 1.0);
  s.target = normal(c, TensorId::target, n, 0.0, 1.0);
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

ReferenceRun reference_run_from(const BlockConfig& c, ReferenceState state, int steps) {
  const I n = c.seq * c.batch * c.hidden;
  const Vec& x = state.input;
  const Vec& target = state.target;
  auto& w = state.params;
  RefBlock block(c);
  ReferenceRun run;
  std::vector<Layer> saved(static_cast<std::size_t>(c.layers));
  std::vector<std::array<Vec, kNumParams>> moment1, moment2;  // AdamW's state
  for (int step = 0; step < steps; ++step) {
    Vec y = x;
    for (std::size_t l = 0; l < saved.size(); ++l) y = block.forward(w[l], y, saved[l]);
    double loss = 0.0;
    Vec dy(y.size());
    for (std::size_t i = 0; i < y.size(); ++i) {
      loss += (y[i] - target[i]) * (y[i] - target[i]);
      dy[i] = (y[i] - target[i]) / double(n);
    }
    run.losses.push_back(0.5 * loss / double(n));
    std::vector<std::array<Vec, kNumParams>> grads(saved.size());
    for (std::size_t l = saved.size(); l-- > 0;) dy = block.backward(w[l], saved[l], dy, grads[l]);
    if (step == 0) {
      run.output = y;
      run.input_grad = dy;
      run.grads = grads;
    }
    if (c.optimizer == Optimizer::sgd) {
      for (std::size_t l = 0; l < w.size(); ++l)
        for (std::size_t p = 0; p < kNumParams; ++p)
          for (std::size_t i = 0; i < w[l][p].size(); ++i) w[l][p][i] -= c.lr * grads[l][p][i];
      continue;
    }
    // AdamW (torch.optim.AdamW) at step t = step + 1: the moments, the decoupled decay (not on
    // the norm gains), the bias-corrected update.
    if (moment1.empty()) {
      moment1 = w;
      moment2 = w;
      for (auto* mom : {&moment1, &moment2})
        for (auto& layer : *mom)
          for (auto& v : layer) std::fill(v.begin(), v.end(), 0.0);
    }
    const double t = double(step + 1);
    const double bias1 = 1.0 - std::pow(c.beta1, t), bias2 = 1.0 - std::pow(c.beta2, t);
    for (std::size_t l = 0; l < w.size(); ++l)
      for (std::size_t p = 0; p < kNumParams; ++p) {
        const bool gain = param_split(kAllParams[p]) == Split::replicated;
        for (std::size_t i = 0; i < w[l][p].size(); ++i) {
          const double g = grads[l][p][i];
          double& m1 = moment1[l][p][i];
          double& m2 = moment2[l][p][i];
          m1 = c.beta1 * m1 + (1.0 - c.beta1) * g;
          m2 = c.beta2 * m2 + (1.0 - c.beta2) * g * g;
          if (!gain) w[l][p][i] -= c.lr * c.weight_decay * w[l][p][i];
          w[l][p][i] -= c.lr * (m1 / bias1) / (std::sqrt(m2 / bias2) + c.eps);
        }
      }
  }
  return run;
}

}  // namespace tpx
