// The language model's ops on cuda (common/cuda/lm.cu) against their cpu twins (common/cpu/lm.cc)
// on the same inputs, fp32 and bf16 as stored: the embedding's gather and scatter-add bit for bit
// (the scatter-add also run twice, bit-identical), the cross-entropy's passes within fp32's
// rounding, over vocabulary shards with begin > 0, padding columns, targets and ids outside the
// shard, a shard with no real column, rows of 64k+ columns, and the kernels' vector (16-byte) and
// scalar paths. A vocabulary cut into three padded shards, put together as the all-reduces would,
// gives the loss and gradient of the whole row computed in double. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/check.h"
#include "common/cuda/device.h"
#include "common/ops.h"
#include "common/stream.h"
#include "test_cuda.h"
#include "test_util.h"

namespace tpx {
namespace {

using I = std::int64_t;
using test::gpu_empty;
using test::on_cpu;
using test::on_gpu;
using test::random_tensor;

constexpr float kInf = std::numeric_limits<float>::infinity();

Tensor ids_tensor(Tensor::Shape shape, const std::vector<std::int32_t>& values) {
  Tensor t = Tensor::empty(std::move(shape), DType::i32);
  EXPECT_EQ(t.numel(), I(values.size()));
  std::copy(values.begin(), values.end(), t.data<std::int32_t>());
  return t;
}

/// A host tensor in `dtype` with the values of the f32 tensor `x` (rounded once for bf16).
Tensor as_dtype(const Tensor& x, DType dtype) {
  if (dtype == DType::f32) return x;
  Tensor t = Tensor::empty(x.shape(), dtype);
  ops::cast(x, t);
  return t;
}

/// A tensor's values as f32 on the host, from either device and either dtype.
Tensor host_f32(const Tensor& t) {
  if (t.device() == Device::cuda) return on_cpu(t);
  if (t.dtype() == DType::f32) return t;
  Tensor w = Tensor::empty(t.shape());
  ops::cast(t, w);
  return w;
}

/// A device tensor of `shape` and `dtype` holding `value` everywhere: what a kernel must overwrite.
Tensor gpu_filled(Tensor::Shape shape, DType dtype, float value) {
  Tensor t = gpu_empty(std::move(shape), dtype);
  ops::fill(t, value);
  return t;
}

std::vector<float> values(const Tensor& t) {
  const Tensor h = host_f32(t);
  return {h.f32().begin(), h.f32().end()};
}

/// Whether two tensors hold the same bits (after a move to the host).
bool bit_identical(const Tensor& a, const Tensor& b) {
  const Tensor ha = on_cpu(a), hb = on_cpu(b);
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0;
}

/// max_i |got_i − want_i| / max_i |want_i|; infinite where one is NaN or where infinities differ.
double rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double err = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
    if (std::isnan(got[i]) || std::isnan(want[i])) return kInf;
    if (std::isinf(got[i]) || std::isinf(want[i])) {
      if (got[i] != want[i]) return kInf;
      continue;
    }
    err = std::max(err, std::abs(double(got[i]) - double(want[i])));
    scale = std::max(scale, std::abs(double(want[i])));
  }
  return scale > 0 ? err / scale : err;
}

const char* name(DType d) {
  return d == DType::f32 ? "f32" : "bf16";
}

/// A device copy of a host tensor in `dtype` (bf16 stored as bf16 there).
Tensor device_copy(const Tensor& host, DType dtype) {
  const Tensor wide = on_gpu(host_f32(host));
  if (dtype == DType::f32) return wide;
  const Tensor t = gpu_empty(host.shape(), dtype);
  ops::cast(wide, t);
  return t;
}

// ---------------------------------------------------------------------------------------------
// The embedding.

struct EmbeddingCase {
  I rows, h, begin;
};
// h = 64: the vector path; 1100: several column tiles of the scatter-add; 13: the scalar path.
const EmbeddingCase kEmbeddingCases[] = {{50, 64, 0}, {37, 1100, 100}, {37, 13, 100}};

/// s·b ids: most in [begin, begin + rows) and many repeated (a row summing several positions),
/// some below begin, some past the shard, −1.
std::vector<std::int32_t> shard_ids(I n, I begin, I rows, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (I t = 0; t < n; ++t) {
    const auto r = gen() % 10;
    I id = begin + I(gen() % 5);  // a few hot rows
    if (r < 3) id = begin + I(gen() % std::uint32_t(rows));
    if (r == 7) id = begin - 1 - I(gen() % 3);
    if (r == 8) id = begin + rows + I(gen() % 7);
    if (r == 9) id = -1;
    ids[std::size_t(t)] = static_cast<std::int32_t>(id);
  }
  ids[0] = static_cast<std::int32_t>(begin + rows - 1);  // the last row
  return ids;
}

TEST(LmOps, EmbeddingForwardIsTheCpuGather) {
  TPX_REQUIRE_GPU();
  const I s = 9, b = 3;
  for (const auto& c : kEmbeddingCases) {
    const Tensor table = random_tensor({c.rows, c.h}, 31);
    const Tensor ids = ids_tensor({s, b}, shard_ids(s * b, c.begin, c.rows, 32));
    for (const DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(testing::Message()
                   << "rows " << c.rows << " h " << c.h << " begin " << c.begin << " " << name(dt));
      Tensor want = Tensor::empty({s, b, c.h}, dt);
      ops::embedding_forward(ids, table, c.begin, want);
      const Tensor got = gpu_filled({s, b, c.h}, dt, 7.0f);
      ops::embedding_forward(on_gpu(ids), on_gpu(table), c.begin, got);
      EXPECT_EQ(values(got), values(want));
    }
  }
}

TEST(LmOps, EmbeddingBackwardIsTheCpuScatterAddAndDeterministic) {
  TPX_REQUIRE_GPU();
  const I s = 64, b = 4;
  for (const auto& c : kEmbeddingCases) {
    const Tensor ids = ids_tensor({s, b}, shard_ids(s * b, c.begin, c.rows, 41));
    const Tensor start = random_tensor({c.rows, c.h}, 42);  // accumulated into
    for (const DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(testing::Message()
                   << "rows " << c.rows << " h " << c.h << " begin " << c.begin << " " << name(dt));
      const Tensor dout = as_dtype(random_tensor({s, b, c.h}, 43), dt);
      Tensor want = Tensor::empty({c.rows, c.h});
      ops::copy(start, want);
      ops::embedding_backward(ids, dout, c.begin, want);
      const Tensor gids = on_gpu(ids), gdout = device_copy(dout, dt);
      const Tensor got = on_gpu(start), again = on_gpu(start);
      ops::embedding_backward(gids, gdout, c.begin, got);
      ops::embedding_backward(gids, gdout, c.begin, again);
      EXPECT_EQ(values(got), values(want));
      EXPECT_TRUE(bit_identical(got, again));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The cross-entropy.

struct ShardCase {
  I n, cols, begin, vocab;
};
const ShardCase kShardCases[] = {
    {24, 256, 768, 1020},       // 252 real columns, 4 padding; both vector paths, a bf16 tail
    {24, 252, 756, 1001},       // 245 real, 7 padding; fp32 vector path, bf16 scalar
    {16, 131, 131, 400},        // odd width: the scalar path, no padding
    {8, 2, 6, 5},               // no real column: max −inf, sumexp 0, gradient 0
    {3, 65536, 65536, 131072},  // long rows, vector path
    {2, 70001, 70001, 140000},  // long rows, scalar path, one padding column
};

/// Targets of every kind: in this shard's real columns, anywhere in the vocabulary, and ids in
/// (or past) the padding.
std::vector<std::int32_t> shard_targets(const ShardCase& c, std::uint32_t seed) {
  std::mt19937 gen(seed);
  const I real = std::max<I>(0, std::min(c.cols, c.vocab - c.begin));
  std::vector<std::int32_t> t(static_cast<std::size_t>(c.n));
  for (I r = 0; r < c.n; ++r) {
    I id = I(gen() % std::uint32_t(c.vocab));
    if (r % 3 == 0 && real > 0) id = c.begin + I(gen() % std::uint32_t(real));
    if (r % 3 == 2) id = c.vocab + r % 4;
    t[std::size_t(r)] = static_cast<std::int32_t>(id);
  }
  return t;
}

TEST(LmOps, CrossEntropyMatchesCpu) {
  TPX_REQUIRE_GPU();
  for (const auto& c : kShardCases) {
    const Tensor z32 = random_tensor({c.n, c.cols}, 51, 0.0, 3.0);
    const Tensor targets = ids_tensor({c.n}, shard_targets(c, 52));
    const Tensor gtargets = on_gpu(targets);
    for (const DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(testing::Message() << "n " << c.n << " cols " << c.cols << " begin " << c.begin
                                      << " vocab " << c.vocab << " " << name(dt));
      const Tensor z = as_dtype(z32, dt), gz = device_copy(z, dt);
      // One pass: max and target exactly, the sum of exponentials to fp32's rounding.
      Tensor m = Tensor::empty({c.n}), s = Tensor::empty({c.n}), tl = Tensor::empty({c.n});
      ops::cross_entropy_partial(z, targets, c.begin, c.vocab, m, s, tl);
      const Tensor gm = gpu_filled({c.n}, DType::f32, 9.0f),
                   gs = gpu_filled({c.n}, DType::f32, 9.0f),
                   gtl = gpu_filled({c.n}, DType::f32, 9.0f);
      ops::cross_entropy_partial(gz, gtargets, c.begin, c.vocab, gm, gs, gtl);
      EXPECT_EQ(values(gm), values(m)) << "max";
      EXPECT_EQ(values(gtl), values(tl)) << "target logit";
      EXPECT_LE(rel_err(values(gs), values(s)), 1e-5) << "sumexp";
      if (c.begin >= c.vocab) {
        for (const float v : values(gm)) EXPECT_EQ(v, -kInf);
        for (const float v : values(gs)) EXPECT_EQ(v, 0.0f);
      }
      // Rescale onto a larger "global" maximum (the MAX all-reduce), from the cpu's partials.
      Tensor global = Tensor::empty({c.n});
      for (I r = 0; r < c.n; ++r)
        global.f32()[r] = std::isinf(m.f32()[r]) ? 1.5f : m.f32()[r] + 0.75f;
      const Tensor gglobal = on_gpu(global), gs2 = on_gpu(s);
      ops::cross_entropy_rescale(m, global, s);
      ops::cross_entropy_rescale(on_gpu(m), gglobal, gs2);
      EXPECT_LE(rel_err(values(gs2), values(s)), 1e-6) << "rescale";
      // The loss from the same (global max, sumexp, target) on both devices; rows with no
      // sum of exponentials here take 1 (another shard's).
      for (I r = 0; r < c.n; ++r)
        if (s.f32()[r] == 0.0f) s.f32()[r] = 1.0f;
      Tensor lse = Tensor::empty({c.n});
      const double loss = ops::cross_entropy_loss(global, s, tl, lse);
      const Tensor glse = gpu_filled({c.n}, DType::f32, 9.0f);
      const double gloss = ops::cross_entropy_loss(gglobal, on_gpu(s), on_gpu(tl), glse);
      EXPECT_LE(rel_err(values(glse), values(lse)), 1e-6) << "lse";
      EXPECT_NEAR(gloss, loss, 1e-6 * std::max(1.0, std::abs(loss))) << "loss";
      // Softmax minus one-hot, times the scale; padding columns 0.
      const double scale = 1.0 / double(c.n);
      Tensor dz = Tensor::empty({c.n, c.cols}, dt);
      ops::cross_entropy_backward(z, targets, lse, c.begin, c.vocab, scale, dz);
      const Tensor gdz = gpu_filled({c.n, c.cols}, dt, 5.0f);
      ops::cross_entropy_backward(gz, gtargets, on_gpu(lse), c.begin, c.vocab, scale, gdz);
      const std::vector<float> got = values(gdz);
      EXPECT_LE(rel_err(got, values(dz)), dt == DType::f32 ? 1e-5 : 0x1p-7) << "dlogits";
      const I real = std::max<I>(0, std::min(c.cols, c.vocab - c.begin));
      for (I r = 0; r < c.n; ++r)
        for (I j = real; j < c.cols; ++j)
          ASSERT_EQ(got[std::size_t(r * c.cols + j)], 0.0f) << "padding row " << r << " col " << j;
    }
  }
}

/// The whole vocabulary cut into three padded shards, each shard's passes on the GPU and the
/// all-reduces (max, sum, sum) done on the host: the loss and the gradient equal the row's
/// softmax cross-entropy computed in double. Padding columns hold huge values that would win every
/// maximum if they were not skipped.
TEST(LmOps, ShardedCrossEntropyIsTheWholeRowsLoss) {
  TPX_REQUIRE_GPU();
  const I n = 20, vocab = 1000, shards = 3, cols = (vocab + shards - 1) / shards;  // 334, 2 pad
  const Tensor z = random_tensor({n, vocab}, 61, 0.0, 2.0);
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  std::mt19937 gen(62);
  for (auto& v : t) v = static_cast<std::int32_t>(gen() % vocab);
  const Tensor targets = on_gpu(ids_tensor({n}, t));
  // Side stream: the ops run on the current stream, whichever it is.
  Stream side = Stream::create(Device::cuda);
  cuda::StreamGuard on_side(side.native());
  std::vector<Tensor> zs, ms, ss, tls;
  std::vector<float> gmax(std::size_t(n), -kInf), gsum(std::size_t(n), 0.0f),
      gtarget(std::size_t(n), 0.0f);
  for (I k = 0; k < shards; ++k) {
    Tensor shard = Tensor::empty({n, cols});
    for (I r = 0; r < n; ++r)
      for (I j = 0; j < cols; ++j)
        shard.f32()[r * cols + j] =
            k * cols + j < vocab ? z.f32()[r * vocab + k * cols + j] : 1e30f;
    zs.push_back(on_gpu(shard));
    ms.push_back(gpu_empty({n}));
    ss.push_back(gpu_empty({n}));
    tls.push_back(gpu_empty({n}));
    ops::cross_entropy_partial(zs.back(), targets, k * cols, vocab, ms.back(), ss.back(),
                               tls.back());
    const std::vector<float> m = values(ms.back()), tl = values(tls.back());
    for (I r = 0; r < n; ++r) {
      gmax[std::size_t(r)] = std::max(gmax[std::size_t(r)], m[std::size_t(r)]);
      gtarget[std::size_t(r)] += tl[std::size_t(r)];
    }
  }
  Tensor hmax = Tensor::empty({n});
  std::copy(gmax.begin(), gmax.end(), hmax.f32().begin());
  const Tensor dmax = on_gpu(hmax);
  for (I k = 0; k < shards; ++k) {
    ops::cross_entropy_rescale(ms[std::size_t(k)], dmax, ss[std::size_t(k)]);
    const std::vector<float> s = values(ss[std::size_t(k)]);
    for (I r = 0; r < n; ++r) gsum[std::size_t(r)] += s[std::size_t(r)];
  }
  Tensor hsum = Tensor::empty({n}), htarget = Tensor::empty({n});
  std::copy(gsum.begin(), gsum.end(), hsum.f32().begin());
  std::copy(gtarget.begin(), gtarget.end(), htarget.f32().begin());
  const Tensor lse = gpu_empty({n});
  const double loss = ops::cross_entropy_loss(dmax, on_gpu(hsum), on_gpu(htarget), lse);
  // In double, from the definition.
  double want_loss = 0.0;
  std::vector<double> want_lse(static_cast<std::size_t>(n));
  for (I r = 0; r < n; ++r) {
    double mx = -INFINITY, sum = 0.0;
    for (I j = 0; j < vocab; ++j) mx = std::max(mx, double(z.f32()[r * vocab + j]));
    for (I j = 0; j < vocab; ++j) sum += std::exp(double(z.f32()[r * vocab + j]) - mx);
    want_lse[std::size_t(r)] = mx + std::log(sum);
    want_loss += want_lse[std::size_t(r)] - double(z.f32()[r * vocab + t[std::size_t(r)]]);
  }
  EXPECT_NEAR(loss, want_loss, 1e-5 * want_loss);
  const double scale = 1.0 / double(n);
  double err = 0.0;
  for (I k = 0; k < shards; ++k) {
    const Tensor dz = gpu_empty({n, cols});
    ops::cross_entropy_backward(zs[std::size_t(k)], targets, lse, k * cols, vocab, scale, dz);
    const std::vector<float> got = values(dz);
    for (I r = 0; r < n; ++r)
      for (I j = 0; j < cols; ++j) {
        const I v = k * cols + j;
        const double want =
            v >= vocab
                ? 0.0
                : scale * (std::exp(double(z.f32()[r * vocab + v]) - want_lse[std::size_t(r)]) -
                           (v == t[std::size_t(r)] ? 1.0 : 0.0));
        err = std::max(err, std::abs(double(got[std::size_t(r * cols + j)]) - want));
      }
  }
  EXPECT_LE(err, 4e-6 * scale);
  side.synchronize();
}

/// A gradient on another device than the table it is scattered into is refused (the cpu loop
/// would read device memory).
TEST(LmOps, EmbeddingBackwardRefusesDoutOnAnotherDevice) {
  TPX_REQUIRE_GPU();
  const Tensor ids = ids_tensor({2, 1}, {0, 1}), dtable = Tensor::zeros({3, 4});
  EXPECT_THROW(ops::embedding_backward(ids, gpu_filled({2, 1, 4}, DType::f32, 1.0f), 0, dtable),
               Error);
  const Tensor dlogits = gpu_empty({2, 3});
  EXPECT_THROW(ops::cross_entropy_backward(random_tensor({2, 3}, 71), ids, Tensor::zeros({2}), 0, 3,
                                           1.0, dlogits),
               Error);
}

}  // namespace
}  // namespace tpx
