// CPU kernels. Straight loops over contiguous rows; the GEMMs (including attention's per-head
// products, addressed in place through CBLAS leading dimensions) go to OpenBLAS.
#include "ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "../check.h"
#include "../config.h"
#include "../ops.h"
#include "../rope.h"

namespace tpx::cpu {
namespace {

using I = std::int64_t;

void expect_f32_cpu(const Tensor& t, const char* what) {
  TPX_CHECK(t.dtype() == DType::f32 && t.device() == Device::cpu, "{} must be f32 on cpu, got {}",
            what, t.describe());
}

void expect_same_numel(const Tensor& a, const Tensor& b) {
  TPX_CHECK(a.numel() == b.numel(), "element counts differ: {} vs {}", a.describe(), b.describe());
}

int to_int(I v) {
  TPX_CHECK(v <= std::numeric_limits<int>::max(), "dimension {} too large for CBLAS", v);
  return static_cast<int>(v);
}

float sigmoid(float z) {
  return 1.0f / (1.0f + std::exp(-z));
}

}  // namespace

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
          float alpha, float beta) {
  expect_f32_cpu(a, "gemm A");
  expect_f32_cpu(b, "gemm B");
  expect_f32_cpu(c, "gemm C");
  const auto [m, n, k] = ::tpx::ops::gemm_dims(a, trans_a, b, trans_b, c);
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, to_int(m), to_int(n), to_int(k), alpha,
              a.data<float>(), to_int(a.cols()), b.data<float>(), to_int(b.cols()), beta,
              c.data<float>(), to_int(n));
}

void rmsnorm_forward(const Tensor& x, const Tensor& g, const Tensor& y, const Tensor& rstd) {
  const I rows = x.rows(), h = x.cols();
  TPX_CHECK(g.numel() == h && y.numel() == x.numel() && rstd.numel() == rows,
            "rmsnorm shapes: x {}, g {}, y {}, rstd {}", x.describe(), g.describe(), y.describe(),
            rstd.describe());
  const float* px = x.data<float>();
  const float* pg = g.data<float>();
  float* py = y.data<float>();
  float* pr = rstd.data<float>();
  for (I r = 0; r < rows; ++r) {
    const float* xr = px + r * h;
    double ss = 0.0;
    for (I i = 0; i < h; ++i) ss += double(xr[i]) * xr[i];
    const auto inv = static_cast<float>(1.0 / std::sqrt(ss / double(h) + kNormEps));
    pr[r] = inv;
    for (I i = 0; i < h; ++i) py[r * h + i] = xr[i] * inv * pg[i];
  }
}

// With n = x·rstd, y = n ⊙ g:  dg = Σ_rows dy ⊙ n,
// dx = rstd · (dy⊙g − n · mean(dy⊙g⊙n)).
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dg) {
  const I rows = x.rows(), h = x.cols();
  TPX_CHECK(dy.numel() == x.numel() && dx.numel() == x.numel() && g.numel() == h &&
                dg.numel() == h && rstd.numel() == rows,
            "rmsnorm_backward shapes");
  const float* pdy = dy.data<float>();
  const float* px = x.data<float>();
  const float* pg = g.data<float>();
  const float* pr = rstd.data<float>();
  float* pdx = dx.data<float>();
  float* pdg = dg.data<float>();
  std::vector<double> dg_acc(static_cast<std::size_t>(h), 0.0);
  for (I r = 0; r < rows; ++r) {
    const float* xr = px + r * h;
    const float* dyr = pdy + r * h;
    const float inv = pr[r];
    double dot = 0.0;  // Σ dy·g·n
    for (I i = 0; i < h; ++i) {
      const float n = xr[i] * inv;
      dot += double(dyr[i]) * pg[i] * n;
      dg_acc[static_cast<std::size_t>(i)] += double(dyr[i]) * n;
    }
    const auto mean = static_cast<float>(dot / double(h));
    for (I i = 0; i < h; ++i) pdx[r * h + i] = inv * (dyr[i] * pg[i] - xr[i] * inv * mean);
  }
  for (I i = 0; i < h; ++i) pdg[i] = static_cast<float>(dg_acc[static_cast<std::size_t>(i)]);
}

namespace {

using AttnDims = ::tpx::ops::AttentionDims;

// q [S, B, heads·D]; k, v [S, B, kv_heads·D] (ops::attention_dims), and the probabilities.
AttnDims attention_dims(const Tensor& q, const Tensor& k, const Tensor& v, I heads,
                        const Tensor& probs) {
  const AttnDims z = ::tpx::ops::attention_dims(q, k, v, heads, "attention");
  TPX_CHECK(probs.numel() == z.b * heads * z.s * z.s, "probs {} must hold [B, heads, S, S]",
            probs.describe());
  return z;
}

}  // namespace

// Per (batch, query head h): P = causal_softmax(Q Kᵀ · scale), O = P V, with K, V those of KV
// head h / (heads / kv_heads). Q, K, V, O of one head are [S, D] matrices with row stride ldq
// (Q, O) or ldkv (K, V) inside the [S, B, X] tensors, so CBLAS reads them in place.
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, I heads,
                       const Tensor& out, const Tensor& probs) {
  const AttnDims z = attention_dims(q, k, v, heads, probs);
  const I s = z.s, d = z.d, nh = z.heads;
  expect_same_numel(q, out);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (I bi = 0; bi < z.b; ++bi) {
    for (I h = 0; h < nh; ++h) {
      const I off = bi * nh * d + h * d;                       // q, out
      const I kv_off = (bi * z.kv_heads + h / z.group()) * d;  // k, v
      float* p = probs.data<float>() + (bi * nh + h) * s * s;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, to_int(s), to_int(s), to_int(d), scale,
                  q.data<float>() + off, to_int(z.ldq), k.data<float>() + kv_off, to_int(z.ldkv),
                  0.0f, p, to_int(s));
      for (I i = 0; i < s; ++i) {  // causal softmax of row i over j <= i, in fp32
        float* row = p + i * s;
        const float mx = *std::max_element(row, row + i + 1);
        float sum = 0.0f;
        for (I j = 0; j <= i; ++j) sum += (row[j] = std::exp(row[j] - mx));
        const float inv = 1.0f / sum;
        for (I j = 0; j <= i; ++j) row[j] *= inv;
        std::fill(row + i + 1, row + s, 0.0f);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, to_int(s), to_int(d), to_int(s), 1.0f,
                  p, to_int(s), v.data<float>() + kv_off, to_int(z.ldkv), 0.0f,
                  out.data<float>() + off, to_int(z.ldq));
    }
  }
}

// dV = Pᵀ dO;  dP = dO Vᵀ;  dS = P ⊙ (dP − rowsum(dP ⊙ P));  dQ = scale·dS K;  dK = scale·dSᵀ Q.
// A KV head's dK and dV sum those of its group of query heads, which are consecutive: the
// group's first head writes them (beta 0), the others add to them (beta 1), in head order.
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& probs, I heads, const Tensor& dq, const Tensor& dk,
                        const Tensor& dv) {
  const AttnDims z = attention_dims(q, k, v, heads, probs);
  const I s = z.s, d = z.d, nh = z.heads;
  for (const Tensor* t : {&dout, &dq}) expect_same_numel(q, *t);
  for (const Tensor* t : {&dk, &dv}) expect_same_numel(k, *t);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int ldq = to_int(z.ldq), ldkv = to_int(z.ldkv);
  std::vector<float> ds(static_cast<std::size_t>(s * s));
  for (I bi = 0; bi < z.b; ++bi) {
    for (I h = 0; h < nh; ++h) {
      const I off = bi * nh * d + h * d;
      const I kv_off = (bi * z.kv_heads + h / z.group()) * d;
      const float beta = h % z.group() == 0 ? 0.0f : 1.0f;  // first of its group: overwrite
      const float* p = probs.data<float>() + (bi * nh + h) * s * s;
      const float* pdo = dout.data<float>() + off;
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, to_int(s), to_int(d), to_int(s), 1.0f, p,
                  to_int(s), pdo, ldq, beta, dv.data<float>() + kv_off, ldkv);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, to_int(s), to_int(s), to_int(d), 1.0f,
                  pdo, ldq, v.data<float>() + kv_off, ldkv, 0.0f, ds.data(), to_int(s));
      for (I i = 0; i < s; ++i) {
        float* row = ds.data() + i * s;
        const float* prow = p + i * s;
        float dot = 0.0f;
        for (I j = 0; j <= i; ++j) dot += row[j] * prow[j];
        for (I j = 0; j <= i; ++j) row[j] = prow[j] * (row[j] - dot);
        std::fill(row + i + 1, row + s, 0.0f);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, to_int(s), to_int(d), to_int(s), scale,
                  ds.data(), to_int(s), k.data<float>() + kv_off, ldkv, 0.0f,
                  dq.data<float>() + off, ldq);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, to_int(s), to_int(d), to_int(s), scale,
                  ds.data(), to_int(s), q.data<float>() + off, ldq, beta, dk.data<float>() + kv_off,
                  ldkv);
    }
  }
}

namespace {

// Rotates every head's pairs (i, i + D/2) of x [S, B, heads*D] by +angle (sign 1) or −angle;
// row p of x is at position first + p.
void rope_rotate(const Tensor& x, I heads, double theta, I first, float sign) {
  expect_f32_cpu(x, "rope x");
  TPX_CHECK(x.ndim() == 3 && heads > 0 && x.dim(2) % heads == 0 && (x.dim(2) / heads) % 2 == 0,
            "rope: {} must be [S, B, heads*D] with {} heads of even D", x.describe(), heads);
  const I s = x.dim(0), b = x.dim(1), d = x.dim(2) / heads, half = d / 2;
  TPX_CHECK(first >= 0, "rope: first position {} must not be negative", first);
  const RopeTable t = rope_table(first + s, d, theta);
  float* px = x.data<float>();
  for (I p = 0; p < s; ++p) {
    const float* cs = t.cos.data() + (first + p) * half;
    const float* sn = t.sin.data() + (first + p) * half;
    for (I r = 0; r < b * heads; ++r) {
      float* head = px + (p * b * heads + r) * d;
      for (I i = 0; i < half; ++i) {
        const float x1 = head[i], x2 = head[i + half], c = cs[i], si = sign * sn[i];
        head[i] = x1 * c - x2 * si;
        head[i + half] = x2 * c + x1 * si;
      }
    }
  }
}

}  // namespace

void rope_forward(const Tensor& x, I heads, double theta, I first) {
  rope_rotate(x, heads, theta, first, 1.0f);
}

// y = R x with R orthogonal, so dx = Rᵀ dy: the same rotation by the opposite angle.
void rope_backward(const Tensor& dx, I heads, double theta, I first) {
  rope_rotate(dx, heads, theta, first, -1.0f);
}

void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& out) {
  expect_same_numel(gate, up);
  expect_same_numel(gate, out);
  auto g = gate.f32(), u = up.f32(), o = out.f32();
  for (std::size_t i = 0; i < g.size(); ++i) o[i] = g[i] * sigmoid(g[i]) * u[i];
}

// d/dz silu(z) = σ(z) · (1 + z · (1 − σ(z))).
void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, const Tensor& dgate,
                     const Tensor& dup) {
  expect_same_numel(gate, dout);
  expect_same_numel(gate, dgate);
  expect_same_numel(gate, dup);
  auto d = dout.f32(), g = gate.f32(), u = up.f32(), dg = dgate.f32(), du = dup.f32();
  for (std::size_t i = 0; i < g.size(); ++i) {
    const float sg = sigmoid(g[i]);
    const float silu = g[i] * sg;
    du[i] = d[i] * silu;
    dg[i] = d[i] * u[i] * sg * (1.0f + g[i] * (1.0f - sg));
  }
}

void add(const Tensor& a, const Tensor& b, const Tensor& out) {
  expect_same_numel(a, b);
  expect_same_numel(a, out);
  auto pa = a.f32(), pb = b.f32(), po = out.f32();
  for (std::size_t i = 0; i < pa.size(); ++i) po[i] = pa[i] + pb[i];
}

void accumulate(const Tensor& x, const Tensor& into) {
  add(into, x, into);
}

double mse_loss_sum(const Tensor& y, const Tensor& t) {
  expect_same_numel(y, t);
  auto py = y.f32(), pt = t.f32();
  double sum = 0.0;
  for (std::size_t i = 0; i < py.size(); ++i) {
    const double diff = double(py[i]) - pt[i];
    sum += diff * diff;
  }
  return sum;
}

void mse_loss_backward(const Tensor& y, const Tensor& t, double scale, const Tensor& dy) {
  expect_same_numel(y, t);
  expect_same_numel(y, dy);
  auto py = y.f32(), pt = t.f32(), pd = dy.f32();
  for (std::size_t i = 0; i < py.size(); ++i) pd[i] = static_cast<float>(scale * (py[i] - pt[i]));
}

namespace {

/// The optimizer's compute copy: element i of a bf16 tensor, or nothing (no copy asked for).
std::uint16_t* copy_bits(const Tensor& copy) {
  return copy.defined() ? static_cast<std::uint16_t*>(copy.raw()) : nullptr;
}

}  // namespace

void sgd_update(const Tensor& w, const Tensor& grad, float lr, const Tensor& copy) {
  expect_same_numel(w, grad);
  auto pw = w.f32(), pg = grad.f32();
  std::uint16_t* pc = copy_bits(copy);
  for (std::size_t i = 0; i < pw.size(); ++i) {
    pw[i] -= lr * pg[i];
    if (pc) pc[i] = bf16_bits(pw[i]);
  }
}

void adamw_update(const Tensor& w, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const ops::AdamWStep& s, const Tensor& copy) {
  auto pw = w.f32(), pg = grad.f32(), pm = m.f32(), pv = v.f32();
  std::uint16_t* pc = copy_bits(copy);
  for (std::size_t i = 0; i < pw.size(); ++i) {
    const float g = pg[i];
    pm[i] = s.beta1 * pm[i] + (1.0f - s.beta1) * g;
    pv[i] = s.beta2 * pv[i] + (1.0f - s.beta2) * (g * g);
    pw[i] *= s.decay;
    pw[i] -= s.step_size * (pm[i] / (std::sqrt(pv[i]) / s.sqrt_bias2 + s.eps));
    if (pc) pc[i] = bf16_bits(pw[i]);
  }
}

double sum_squares(const Tensor& x) {
  double sum = 0.0;
  for (float v : x.f32()) sum += double(v) * v;
  return sum;
}

std::vector<double> sum_squares_each(const std::vector<Tensor>& xs) {
  std::vector<double> out;
  for (const Tensor& x : xs) out.push_back(sum_squares(x));
  return out;
}

void fill(const Tensor& t, float value) {
  auto p = t.f32();
  std::fill(p.begin(), p.end(), value);
}

}  // namespace tpx::cpu
