// The CUDA backend against the CPU backend: every op on the same inputs, both vectorised
// (16-byte aligned, sizes multiple of 4/8) and scalar (odd sizes, offset views) kernel paths;
// bf16 casts bit-exact against the host rounding; the error-check macros, the allocator's size
// classes and device_problem() (these three also run without a GPU). Tests that need a GPU skip
// with the reason when none is visible. ctest names them cuda.<Suite>.<Test>.
#include <cublas_api.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/cpu/ops.h"
#include "common/cuda/allocator.h"
#include "common/cuda/blas.h"
#include "common/cuda/check.h"
#include "common/cuda/device.h"
#include "common/cuda/ops.h"
#include "common/fp8_bits.h"
#include "common/lowp.h"
#include "common/ops.h"
#include "common/stream.h"
#include "test_cuda.h"
#include "test_util.h"
#if TPX_WITH_NCCL
#include "common/cuda/nccl_check.h"
#endif

namespace tpx {
namespace {

using test::random_tensor;
using I = std::int64_t;

using test::gpu_empty;
using test::on_cpu;
using test::on_gpu;
Tensor cpu_empty(Tensor::Shape shape) {
  return Tensor::empty(std::move(shape));
}

/// max |got − want| / max |want| (the --check metric), got from any device.
double rel_err(const Tensor& got, const Tensor& want) {
  const Tensor g = on_cpu(got);
  EXPECT_EQ(g.numel(), want.numel());
  double err = 0.0, scale = 0.0;
  auto gs = g.f32(), ws = want.f32();
  for (std::size_t i = 0; i < ws.size() && i < gs.size(); ++i) {
    err = std::max(err, std::abs(double(gs[i]) - double(ws[i])));
    if (std::isnan(gs[i])) err = INFINITY;
    scale = std::max(scale, std::abs(double(ws[i])));
  }
  return scale > 0 ? err / scale : err;
}

/// A copy of a cpu tensor with every value rounded to bf16 (what a bf16 GEMM multiplies).
Tensor rounded_to_bf16(const Tensor& t) {
  Tensor r = cpu_empty(t.shape());
  auto in = t.f32(), out = r.f32();
  for (std::size_t i = 0; i < in.size(); ++i) out[i] = bf16_value(bf16_bits(in[i]));
  return r;
}

constexpr double kF32Tol = 1e-5;

// ---------------------------------------------------------------------------------------------
// Without a GPU.

TEST(BlasLoader, CublasIsOpenedByItsFirstCallNotAtStart) {
  // Each ctest case is a process of its own: nothing has called cuBLAS yet. Linked, the library
  // would be mapped before main (0.2 s and 210 MiB per process on every rank of every run).
  EXPECT_FALSE(cuda::blas::loaded()) << "cuBLAS was mapped before any call";
  // cublasGetStatusName needs no GPU; the forwarder opens libcublas and finds the function.
  EXPECT_STREQ(cublasGetStatusName(CUBLAS_STATUS_NOT_INITIALIZED), "CUBLAS_STATUS_NOT_INITIALIZED");
  EXPECT_TRUE(cuda::blas::loaded());
}

TEST(Check, MacrosNameTheCallAndTheLibrarysError) {
  // cudaSetDevice(-1) fails everywhere: an invalid ordinal with a GPU, no driver without one.
  try {
    TPX_CUDA_CHECK(cudaSetDevice(-1));
    FAIL() << "TPX_CUDA_CHECK did not throw";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cudaSetDevice(-1) failed"), std::string::npos) << what;
    EXPECT_NE(what.find("test_cuda_ops.cc:"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  // With a GPU the error is not sticky and the macro clears it (without a driver, every call
  // keeps failing).
  if (ops::device_problem(Device::cuda).empty()) {
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
  try {
    TPX_CUBLAS_CHECK(CUBLAS_STATUS_INVALID_VALUE);
    FAIL() << "TPX_CUBLAS_CHECK did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CUBLAS_STATUS_INVALID_VALUE"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(TPX_CUBLAS_CHECK(CUBLAS_STATUS_SUCCESS));
#if TPX_WITH_NCCL
  try {
    TPX_NCCL_CHECK(ncclInvalidArgument);
    FAIL() << "TPX_NCCL_CHECK did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ncclInvalidArgument failed"), std::string::npos)
        << e.what();
  }
#endif
}

TEST(Device, ProblemIsEmptyOrOneClearLine) {
  int count = 0;
  const bool visible = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  (void)cudaGetLastError();
  const std::string why = ops::device_problem(Device::cuda);
  if (visible) {
    EXPECT_EQ(why, "");
  } else {
    EXPECT_EQ(why.rfind("--device cuda: no CUDA device is visible", 0), 0u) << why;
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  }
}

TEST(Allocator, SizeClassesCoverRequestsWithLittleWaste) {
  using A = cuda::CachingAllocator;
  EXPECT_EQ(A::size_class(0), 512u);
  EXPECT_EQ(A::size_class(1), 512u);
  EXPECT_EQ(A::size_class(513), 1024u);
  EXPECT_EQ(A::size_class(std::size_t{1} << 20), std::size_t{1} << 20);
  EXPECT_EQ(A::size_class((std::size_t{1} << 20) + 1),
            (std::size_t{1} << 20) + (std::size_t{1} << 17));
  std::size_t previous = 0;
  for (std::size_t bytes = 1; bytes < (std::size_t{1} << 34); bytes = bytes * 5 / 4 + 7) {
    const std::size_t c = A::size_class(bytes);
    EXPECT_GE(c, bytes);
    EXPECT_GE(c, previous);  // monotone: a larger request never gets a smaller block
    EXPECT_EQ(c % 512, 0u);
    if (bytes > 4096) {
      EXPECT_LE(double(c), 1.125 * double(bytes)) << bytes;
    }
    previous = c;
  }
}

TEST(Bf16, HostRoundingIsNearestEven) {
  EXPECT_EQ(bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(bf16_bits(1.0f + 0x1p-8f), 0x3f80);             // tie, rounds to the even 0x3f80
  EXPECT_EQ(bf16_bits(1.0f + 3 * 0x1p-8f), 0x3f82);         // tie, rounds up to the even 0x3f82
  EXPECT_EQ(bf16_bits(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);  // above the tie
  EXPECT_EQ(bf16_bits(-2.0f), 0xc000);
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::max()), 0x7f80);  // overflows to inf
  EXPECT_TRUE(std::isnan(bf16_value(bf16_bits(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(bf16_value(0x3f81), 1.0f + 0x1p-7f);
}

// ---------------------------------------------------------------------------------------------
// With a GPU.

TEST(Allocator, CountsBytesAndReusesFreedBlocks) {
  TPX_REQUIRE_GPU();
  Allocator& a = allocator_for(Device::cuda);
  const MemoryStats before = a.stats();
  void* p = a.allocate(1000);
  EXPECT_EQ(a.stats().current, before.current + 1000);
  EXPECT_GE(a.stats().peak, before.current + 1000);
  a.deallocate(p, 1000);
  EXPECT_EQ(a.stats().current, before.current);
  void* q = a.allocate(900);  // same size class: the cached block comes back
  EXPECT_EQ(q, p);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(q) % 256, 0u);
  a.deallocate(q, 900);
}

TEST(Stream, EventsOrderWorkAcrossStreams) {
  TPX_REQUIRE_GPU();
  const Tensor host = random_tensor({4096}, 1);
  const Tensor x = on_gpu(host);
  const Tensor y = gpu_empty({4096});
  Stream side = Stream::create(Device::cuda);
  Event done(Device::cuda);
  {
    cuda::StreamGuard on_side(side.native());
    ops::fill(y, 0.0f);
    ops::accumulate(x, y);  // y = x, on the side stream
    done.record(side);
  }
  done.wait(Stream(Device::cuda));  // the default stream waits on the device
  ops::accumulate(x, y);            // y = 2x, ordered after the side stream's work
  ops::synchronize(Device::cuda);
  EXPECT_TRUE(done.ready());
  done.synchronize();
  side.synchronize();
  Tensor want = cpu_empty({4096});
  cpu::add(host, host, want);
  EXPECT_EQ(rel_err(y, want), 0.0);
}

TEST(Ops, ElementwiseMatchCpu) {
  TPX_REQUIRE_GPU();
  // 4096: float4 path; 1001: scalar path; a view at a 4-byte offset: scalar path on misalignment.
  for (const I n : {I{4096}, I{1001}}) {
    for (const bool offset : {false, true}) {
      SCOPED_TRACE(testing::Message() << "n " << n << " offset " << offset);
      auto view = [&](const Tensor& t) { return offset ? t.slice0(1, n + 1) : t.slice0(0, n); };
      const Tensor a = random_tensor({n + 1}, 2), b = random_tensor({n + 1}, 3);
      const Tensor da = on_gpu(a), db = on_gpu(b);
      const Tensor ha = view(a), hb = view(b), ga = view(da), gb = view(db);
      Tensor want = cpu_empty({n}), got = gpu_empty({n});

      cpu::add(ha, hb, want);
      ops::add(ga, gb, got);
      EXPECT_LE(rel_err(got, want), 0.0) << "add";

      ops::copy(ga, got);
      ops::accumulate(gb, got);
      EXPECT_LE(rel_err(got, want), 0.0) << "accumulate";

      cpu::swiglu_forward(ha, hb, want);
      ops::swiglu_forward(ga, gb, got);
      EXPECT_LE(rel_err(got, want), kF32Tol) << "swiglu_forward";

      const Tensor dout = random_tensor({n}, 4);
      Tensor wdg = cpu_empty({n}), wdu = cpu_empty({n});
      Tensor gdg = gpu_empty({n}), gdu = gpu_empty({n});
      cpu::swiglu_backward(dout, ha, hb, wdg, wdu);
      ops::swiglu_backward(on_gpu(dout), ga, gb, gdg, gdu);
      EXPECT_LE(rel_err(gdg, wdg), kF32Tol) << "swiglu_backward dgate";
      EXPECT_LE(rel_err(gdu, wdu), kF32Tol) << "swiglu_backward dup";

      cpu::mse_loss_backward(ha, hb, 1.0 / double(n), want);
      ops::mse_loss_backward(ga, gb, 1.0 / double(n), got);
      EXPECT_LE(rel_err(got, want), kF32Tol) << "mse_loss_backward";

      // Sums of squares in double on both sides: only the summation order differs.
      EXPECT_NEAR(ops::mse_loss_sum(ga, gb), cpu::mse_loss_sum(ha, hb),
                  1e-12 * cpu::mse_loss_sum(ha, hb));
      EXPECT_NEAR(ops::sum_squares(ga), cpu::sum_squares(ha), 1e-12 * cpu::sum_squares(ha));

      Tensor w = cpu_empty({n});
      ops::copy(ha, w);
      const Tensor gw = on_gpu(w);
      cpu::sgd_update(w, hb, 0.3f, Tensor());
      ops::sgd_update(gw, gb, 0.3f);
      EXPECT_EQ(rel_err(gw, w), 0.0) << "sgd_update";  // the product rounded on its own

      ops::fill(got, 2.5f);
      cpu::fill(want, 2.5f);
      EXPECT_EQ(rel_err(got, want), 0.0) << "fill";
    }
  }
}

// The element-wise ops on bf16 tensors: on cuda their kernels read and write bf16 as stored
// (common/cuda/elementwise_ops.h), on the cpu Fp32Boundary widens and rounds around the fp32 op;
// the rounding points are the same, so where the fp32 math is the same (add, accumulate, fill,
// the loss's gradient, RoPE) the bits are, and SwiGLU and RMSNorm (expf, FMA, the statistic's
// summation order) differ by at most one bf16 spacing of their outputs.
TEST(Ops, Bf16ElementwiseMatchCpuBoundary) {
  TPX_REQUIRE_GPU();
  auto bf16 = [](const Tensor& f32) {
    Tensor t = Tensor::empty(f32.shape(), DType::bf16);
    ops::cast(f32, t);
    return t;
  };
  auto host_f32 = [](const Tensor& t) {  // a tensor's values, widened, on the host
    if (t.device() == Device::cuda) return on_cpu(t);
    Tensor w = Tensor::empty(t.shape());
    ops::cast(t, w);
    return w;
  };
  const double one_rounding = 0x1p-7;  // one bf16 spacing, relative: 2^-8 to 2^-7
  for (const I n : {I{4096}, I{1001}}) {
    SCOPED_TRACE(testing::Message() << "n " << n);
    const Tensor a = bf16(random_tensor({n}, 21)), b = bf16(random_tensor({n}, 22));
    const Tensor t32 = random_tensor({n}, 23);
    const Tensor ga = on_gpu(a), gb = on_gpu(b), gt = on_gpu(t32);
    Tensor want = Tensor::empty({n}, DType::bf16), got = gpu_empty({n}, DType::bf16);
    ops::add(a, b, want);
    ops::add(ga, gb, got);
    EXPECT_EQ(rel_err(got, host_f32(want)), 0.0) << "add";
    ops::copy(ga, got);
    ops::accumulate(gb, got);
    EXPECT_EQ(rel_err(got, host_f32(want)), 0.0) << "accumulate";
    ops::mse_loss_backward(a, t32, 1.0 / double(n), want);
    ops::mse_loss_backward(ga, gt, 1.0 / double(n), got);
    EXPECT_EQ(rel_err(got, host_f32(want)), 0.0) << "mse_loss_backward";
    EXPECT_NEAR(ops::mse_loss_sum(ga, gt), ops::mse_loss_sum(a, t32),
                1e-12 * ops::mse_loss_sum(a, t32));
    EXPECT_NEAR(ops::sum_squares(ga), ops::sum_squares(a), 1e-12 * ops::sum_squares(a));
    ops::fill(want, 0.1f);
    ops::fill(got, 0.1f);
    EXPECT_EQ(rel_err(got, host_f32(want)), 0.0) << "fill";
    ops::swiglu_forward(a, b, want);
    ops::swiglu_forward(ga, gb, got);
    EXPECT_LE(rel_err(got, host_f32(want)), one_rounding) << "swiglu_forward";
    Tensor wdg = Tensor::empty({n}, DType::bf16), wdu = Tensor::empty({n}, DType::bf16);
    Tensor gdg = gpu_empty({n}, DType::bf16), gdu = gpu_empty({n}, DType::bf16);
    ops::swiglu_backward(b, a, b, wdg, wdu);
    ops::swiglu_backward(gb, ga, gb, gdg, gdu);
    EXPECT_LE(rel_err(gdg, host_f32(wdg)), one_rounding) << "swiglu_backward dgate";
    EXPECT_LE(rel_err(gdu, host_f32(wdu)), one_rounding) << "swiglu_backward dup";
  }
  const I s = 8, batch = 2, heads = 4, d = 16, rows = s * batch, h = heads * d;
  const Tensor x = bf16(random_tensor({s, batch, h}, 24)), g = random_tensor({h}, 25, 1.0, 0.1);
  const Tensor gx = on_gpu(x);
  ops::rope_forward(x, heads, 10000.0, 3);
  ops::rope_forward(gx, heads, 10000.0, 3);
  EXPECT_EQ(rel_err(gx, host_f32(x)), 0.0) << "rope";
  const Tensor x2 = x.reshape({rows, h}), gx2 = gx.reshape({rows, h});
  Tensor y = Tensor::empty({rows, h}, DType::bf16), rstd = cpu_empty({rows});
  Tensor gy = gpu_empty({rows, h}, DType::bf16), grstd = gpu_empty({rows});
  ops::rmsnorm_forward(x2, g, y, rstd);
  ops::rmsnorm_forward(gx2, on_gpu(g), gy, grstd);
  EXPECT_LE(rel_err(gy, host_f32(y)), one_rounding) << "rmsnorm y";
  EXPECT_LE(rel_err(grstd, rstd), kF32Tol) << "rmsnorm rstd";
  Tensor dx = Tensor::empty({rows, h}, DType::bf16), dg = cpu_empty({h});
  Tensor gdx = gpu_empty({rows, h}, DType::bf16), gdg = gpu_empty({h});
  ops::rmsnorm_backward(y, x2, g, rstd, dx, dg);
  ops::rmsnorm_backward(gy, gx2, on_gpu(g), grstd, gdx, gdg);
  EXPECT_LE(rel_err(gdx, host_f32(dx)), 4 * one_rounding) << "rmsnorm dx";
  EXPECT_LE(rel_err(gdg, dg), 4 * one_rounding) << "rmsnorm dg";
}

TEST(Ops, CastsAreBitExactRoundToNearestEven) {
  TPX_REQUIRE_GPU();
  for (const I n : {I{64}, I{13}}) {  // 8-wide vector path, scalar path
    Tensor src = random_tensor({n}, 5, 0.0, 100.0);
    auto s = src.f32();
    s[0] = 1.0f + 0x1p-8f;  // ties
    s[1] = 1.0f + 3 * 0x1p-8f;
    s[2] = -0.0f;
    s[3] = std::numeric_limits<float>::infinity();
    s[4] = std::numeric_limits<float>::max();
    s[5] = std::numeric_limits<float>::denorm_min() * 3;
    s[6] = std::numeric_limits<float>::quiet_NaN();
    const Tensor g16 = gpu_empty({n}, DType::bf16);
    ops::cast(on_gpu(src), g16);
    const Tensor h16 = Tensor::empty({n}, DType::bf16);
    ops::copy(g16, h16);
    const auto* bits = h16.data<std::uint16_t>();
    for (I i = 0; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i);
      if (std::isnan(s[k])) {
        EXPECT_TRUE(std::isnan(bf16_value(bits[i])));
      } else {
        EXPECT_EQ(bits[i], bf16_bits(s[k])) << "element " << i << " = " << s[k];
      }
    }
    // Back to f32: exact (bf16 is a prefix of f32).
    const Tensor back = ops::to_device(g16, Device::cpu);  // bf16 on cuda -> f32 on the host
    ASSERT_EQ(back.dtype(), DType::f32);
    for (I i = 7; i < n; ++i)
      EXPECT_EQ(std::bit_cast<std::uint32_t>(back.f32()[static_cast<std::size_t>(i)]),
                std::uint32_t{bits[i]} << 16);
  }
}

TEST(Ops, RmsNormMatchesCpu) {
  TPX_REQUIRE_GPU();
  struct Case {
    I rows, h;
  };
  // vectorised rows; odd width (scalar path); many rows (several dg chunks).
  for (const Case c : {Case{37, 64}, Case{5, 67}, Case{1000, 256}}) {
    SCOPED_TRACE(testing::Message() << "rows " << c.rows << " h " << c.h);
    const Tensor x = random_tensor({c.rows, c.h}, 6), g = random_tensor({c.h}, 7, 1.0, 0.1);
    const Tensor dy = random_tensor({c.rows, c.h}, 8);
    Tensor y = cpu_empty({c.rows, c.h}), rstd = cpu_empty({c.rows});
    Tensor dx = cpu_empty({c.rows, c.h}), dg = cpu_empty({c.h});
    cpu::rmsnorm_forward(x, g, y, rstd);
    cpu::rmsnorm_backward(dy, x, g, rstd, dx, dg);
    const Tensor gx = on_gpu(x), gg = on_gpu(g);
    Tensor gy = gpu_empty({c.rows, c.h}), grstd = gpu_empty({c.rows});
    Tensor gdx = gpu_empty({c.rows, c.h}), gdg = gpu_empty({c.h});
    ops::rmsnorm_forward(gx, gg, gy, grstd);
    ops::rmsnorm_backward(on_gpu(dy), gx, gg, grstd, gdx, gdg);
    EXPECT_LE(rel_err(gy, y), kF32Tol) << "y";
    EXPECT_LE(rel_err(grstd, rstd), kF32Tol) << "rstd";
    EXPECT_LE(rel_err(gdx, dx), kF32Tol) << "dx";
    EXPECT_LE(rel_err(gdg, dg), kF32Tol) << "dg";
  }
}

TEST(Ops, GemmFp32AllTransposesMatchCpu) {
  TPX_REQUIRE_GPU();
  struct Case {
    I m, n, k;
  };
  for (const Case c : {Case{33, 17, 45}, Case{128, 64, 96}}) {
    for (const bool ta : {false, true}) {
      for (const bool tb : {false, true}) {
        SCOPED_TRACE(testing::Message()
                     << c.m << "x" << c.n << "x" << c.k << " ta " << ta << " tb " << tb);
        const Tensor a = random_tensor(ta ? Tensor::Shape{c.k, c.m} : Tensor::Shape{c.m, c.k}, 9);
        const Tensor b = random_tensor(tb ? Tensor::Shape{c.n, c.k} : Tensor::Shape{c.k, c.n}, 10);
        const Tensor c0 = random_tensor({c.m, c.n}, 11);
        Tensor want = cpu_empty({c.m, c.n});
        ops::copy(c0, want);
        cpu::gemm(a, ta, b, tb, want, 0.5f, 0.25f);
        const Tensor got = on_gpu(c0);
        ops::gemm(on_gpu(a), ta, on_gpu(b), tb, got, 0.5f, 0.25f);
        EXPECT_LE(rel_err(got, want), kF32Tol);
        // The same product on views one row into larger buffers: with odd widths every pointer is
        // only 4-byte aligned, so cuBLASLt must be told (a plan assuming 16 or 256 bytes faults).
        auto shifted = [](const Tensor& t) {
          const Tensor big = gpu_empty({t.dim(0) + 1, t.dim(1)});
          const Tensor view = big.slice0(1, t.dim(0) + 1);
          ops::copy(t, view);
          return view;
        };
        const Tensor got_view = shifted(c0);
        ops::gemm(shifted(a), ta, shifted(b), tb, got_view, 0.5f, 0.25f);
        EXPECT_LE(rel_err(got_view, want), kF32Tol) << "offset views";
      }
    }
  }
}

// bf16 GEMM = exact products of bf16-rounded operands (8-bit significands multiply exactly into
// fp32) summed in fp32. So it must equal an fp32 GEMM of the host-rounded operands up to fp32
// summation order; 1e-4 leaves room for the tensor cores' internal adder rounding, while a
// missing rounding or a wrong operand shows up as O(1e-3) to O(1).
TEST(Ops, GemmBf16IsFp32GemmOfRoundedOperands) {
  TPX_REQUIRE_GPU();
  const I m = 64, n = 48, k = 200;
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) {
      SCOPED_TRACE(testing::Message() << "ta " << ta << " tb " << tb);
      const Tensor a = random_tensor(ta ? Tensor::Shape{k, m} : Tensor::Shape{m, k}, 12);
      const Tensor b = random_tensor(tb ? Tensor::Shape{n, k} : Tensor::Shape{k, n}, 13);
      Tensor want = cpu_empty({m, n});
      cpu::gemm(rounded_to_bf16(a), ta, rounded_to_bf16(b), tb, want, 1.0f, 0.0f);
      const Tensor got = gpu_empty({m, n});
      ops::gemm(on_gpu(a), ta, on_gpu(b), tb, got, 1.0f, 0.0f, DType::bf16);
      EXPECT_LE(rel_err(got, want), 1e-4);
      Tensor unrounded = cpu_empty({m, n});  // and it really did round: fp32 differs
      cpu::gemm(a, ta, b, tb, unrounded, 1.0f, 0.0f);
      EXPECT_GT(rel_err(got, unrounded), 1e-5);
    }
  }
}

struct AttnCase {
  I s, b, heads, d;
  I kv = 0;  ///< KV heads (grouped-query attention); 0: as many as query heads
};

void check_attention(const AttnCase& c, DType compute, double tol) {
  const I kv = c.kv == 0 ? c.heads : c.kv;
  SCOPED_TRACE(testing::Message() << "S " << c.s << " B " << c.b << " heads " << c.heads << " kv "
                                  << kv << " D " << c.d << " " << to_string(compute));
  const Tensor::Shape act{c.s, c.b, c.heads * c.d}, kv_act{c.s, c.b, kv * c.d};
  const Tensor::Shape pr{c.b, c.heads, c.s, c.s};
  const Tensor q = random_tensor(act, 14), k = random_tensor(kv_act, 15),
               v = random_tensor(kv_act, 16);
  const Tensor dout = random_tensor(act, 17);
  Tensor out = cpu_empty(act), probs = cpu_empty(pr);
  Tensor dq = cpu_empty(act), dk = cpu_empty(kv_act), dv = cpu_empty(kv_act);
  cpu::attention_forward(q, k, v, c.heads, out, probs);
  cpu::attention_backward(dout, q, k, v, probs, c.heads, dq, dk, dv);

  const Tensor gq = on_gpu(q), gk = on_gpu(k), gv = on_gpu(v);
  Tensor gout = gpu_empty(act), gprobs = gpu_empty(pr);
  Tensor gdq = gpu_empty(act), gdk = gpu_empty(kv_act), gdv = gpu_empty(kv_act);
  ops::fill(gprobs, 7.0f);  // the zeros above the diagonal must be written, not assumed
  ops::fill(gdk, 7.0f);     // dK, dV accumulate over a group: they must be overwritten first
  ops::fill(gdv, 7.0f);
  ops::attention_forward(gq, gk, gv, c.heads, gout, gprobs, compute);
  ops::attention_backward(on_gpu(dout), gq, gk, gv, gprobs, c.heads, gdq, gdk, gdv, compute);
  EXPECT_LE(rel_err(gout, out), tol) << "out";
  EXPECT_LE(rel_err(gprobs, probs), tol) << "probs";
  EXPECT_LE(rel_err(gdq, dq), tol) << "dq";
  EXPECT_LE(rel_err(gdk, dk), tol) << "dk";
  EXPECT_LE(rel_err(gdv, dv), tol) << "dv";
}

TEST(Ops, AttentionFp32MatchesCpu) {
  TPX_REQUIRE_GPU();
  check_attention({32, 2, 4, 8}, DType::f32, kF32Tol);   // float4 softmax rows
  check_attention({33, 2, 3, 16}, DType::f32, kF32Tol);  // odd S: scalar softmax rows
  check_attention({128, 1, 2, 64}, DType::f32, kF32Tol);
}

// Grouped-query attention: one batched GEMM per member of the groups, dK and dV summed over them.
TEST(Ops, GroupedQueryAttentionFp32MatchesCpu) {
  TPX_REQUIRE_GPU();
  check_attention({32, 2, 4, 8, 2}, DType::f32, kF32Tol);
  check_attention({33, 2, 6, 16, 3}, DType::f32, kF32Tol);
  check_attention({64, 1, 4, 32, 1}, DType::f32, kF32Tol);  // one KV head: batch of one
}

TEST(Ops, GroupedQueryAttentionBf16CloseToCpu) {
  TPX_REQUIRE_GPU();
  check_attention({32, 2, 4, 8, 2}, DType::bf16, 3e-2);
  check_attention({33, 1, 4, 16, 1}, DType::bf16, 3e-2);
}

// The fused (FlashAttention-2) kernels against the cpu's fused attention, with and without
// grouping: fp32 on CUDA cores, bf16 on tensor cores (D = 32, 64) and CUDA cores (D = 16).
void check_fused_attention(const AttnCase& c, DType compute, double tol) {
  const I kv = c.kv == 0 ? c.heads : c.kv;
  SCOPED_TRACE(testing::Message() << "fused S " << c.s << " B " << c.b << " heads " << c.heads
                                  << " kv " << kv << " D " << c.d << " " << to_string(compute));
  const Tensor::Shape act{c.s, c.b, c.heads * c.d}, kv_act{c.s, c.b, kv * c.d};
  const Tensor q = random_tensor(act, 24), k = random_tensor(kv_act, 25),
               v = random_tensor(kv_act, 26), dout = random_tensor(act, 27);
  Tensor out = cpu_empty(act), lse = cpu_empty({c.b, c.heads, c.s});
  Tensor dq = cpu_empty(act), dk = cpu_empty(kv_act), dv = cpu_empty(kv_act);
  cpu::attention_fused_forward(q, k, v, c.heads, out, lse);
  cpu::attention_fused_backward(dout, q, k, v, out, lse, c.heads, dq, dk, dv);

  const Tensor gq = on_gpu(q), gk = on_gpu(k), gv = on_gpu(v);
  Tensor gout = gpu_empty(act), glse = gpu_empty({c.b, c.heads, c.s});
  Tensor gdq = gpu_empty(act), gdk = gpu_empty(kv_act), gdv = gpu_empty(kv_act);
  for (const Tensor* t : {&gout, &glse, &gdq, &gdk, &gdv})
    ops::fill(*t, std::numeric_limits<float>::quiet_NaN());  // every element must be written
  ops::attention_fused_forward(gq, gk, gv, c.heads, gout, glse, compute);
  ops::attention_fused_backward(on_gpu(dout), gq, gk, gv, gout, glse, c.heads, gdq, gdk, gdv,
                                compute);
  EXPECT_LE(rel_err(gout, out), tol) << "out";
  EXPECT_LE(rel_err(glse, lse), tol) << "lse";
  EXPECT_LE(rel_err(gdq, dq), tol) << "dq";
  EXPECT_LE(rel_err(gdk, dk), tol) << "dk";
  EXPECT_LE(rel_err(gdv, dv), tol) << "dv";
}

TEST(Ops, FusedGroupedQueryAttentionMatchesCpu) {
  TPX_REQUIRE_GPU();
  for (const AttnCase& c : {AttnCase{77, 2, 4, 64, 2}, AttnCase{77, 2, 4, 16, 1},
                            AttnCase{40, 1, 6, 32, 3}, AttnCase{40, 1, 2, 64}}) {
    // fp32: the online softmax rescales each output once per key, more roundings than the naive
    // path's; 1e-4 (test_attention's bound against double) leaves room, a bug is off by O(1).
    check_fused_attention(c, DType::f32, 1e-4);
    check_fused_attention(c, DType::bf16, 3e-2);
  }
}

// The recipe's case: bf16 tensors on cuda, read and written as stored (no fp32 copies, outputs
// rounded once) by the fused kernels and by the naive GEMMs, against the cpu's attention on the
// same bf16 tensors (through its op boundary). S = 1 (one key: dq and dk are the cancellation of
// dS), S not a multiple of a tile, grouped-query attention (the naive dK, dV summed over a group
// in fp32); tensor cores at D = 32, 64, 128, CUDA cores at 16.
TEST(Ops, AttentionOnBf16TensorsMatchesCpu) {
  TPX_REQUIRE_GPU();
  auto bf16_copy = [](const Tensor& t, Device device) {
    const Tensor b = Tensor::empty(t.shape(), DType::bf16, device);
    ops::cast(device == Device::cpu ? t : on_gpu(t), b);
    return b;
  };
  auto f32_on_cpu = [](const Tensor& t) {
    if (t.dtype() == DType::f32) return on_cpu(t);
    const Tensor w = Tensor::empty(t.shape(), DType::f32, t.device());
    ops::cast(t, w);
    return on_cpu(w);
  };
  for (const AttnCase& c :
       {AttnCase{1, 1, 2, 64}, AttnCase{1, 2, 4, 128, 2}, AttnCase{77, 2, 4, 64, 2},
        AttnCase{77, 2, 4, 16, 1}, AttnCase{40, 1, 6, 32, 3}, AttnCase{130, 1, 4, 128, 1}})
    for (bool naive : {false, true}) {
      const I kv = c.kv == 0 ? c.heads : c.kv;
      SCOPED_TRACE(testing::Message()
                   << (naive ? "naive" : "fused") << ", bf16 tensors, S " << c.s << " B " << c.b
                   << " heads " << c.heads << " kv " << kv << " D " << c.d);
      const Tensor::Shape act{c.s, c.b, c.heads * c.d}, kv_act{c.s, c.b, kv * c.d};
      const Tensor q = random_tensor(act, 34), k = random_tensor(kv_act, 35),
                   v = random_tensor(kv_act, 36), dout = random_tensor(act, 37);
      Tensor want[5], got[5];  // out, lse or probs, dq, dk, dv
      for (Device device : {Device::cpu, Device::cuda}) {
        auto empty = [&](Tensor::Shape shape, DType dtype) {
          return Tensor::empty(std::move(shape), dtype, device);
        };
        const Tensor bq = bf16_copy(q, device), bk = bf16_copy(k, device),
                     bv = bf16_copy(v, device), bdout = bf16_copy(dout, device);
        const Tensor out = empty(act, DType::bf16);
        const Tensor stats = naive ? empty({c.b, c.heads, c.s, c.s}, DType::f32)
                                   : empty({c.b, c.heads, c.s}, DType::f32);
        const Tensor dq = empty(act, DType::bf16), dk = empty(kv_act, DType::bf16),
                     dv = empty(kv_act, DType::bf16);
        if (naive) {
          ops::attention_forward(bq, bk, bv, c.heads, out, stats, DType::bf16);
          ops::attention_backward(bdout, bq, bk, bv, stats, c.heads, dq, dk, dv, DType::bf16);
        } else {
          ops::attention_fused_forward(bq, bk, bv, c.heads, out, stats, DType::bf16);
          ops::attention_fused_backward(bdout, bq, bk, bv, out, stats, c.heads, dq, dk, dv,
                                        DType::bf16);
        }
        Tensor* r = device == Device::cpu ? want : got;
        const Tensor* t[5] = {&out, &stats, &dq, &dk, &dv};
        for (int i = 0; i < 5; ++i) r[i] = f32_on_cpu(*t[i]);
      }
      const char* names[] = {"out", naive ? "probs" : "lse", "dq", "dk", "dv"};
      for (int i = 0; i < 5; ++i) {
        if (c.s == 1 && (i == 2 || i == 3)) {
          // One key: dq and dk are exactly 0 (dP = Δ), both backends leave fp32 roundoff of
          // terms of size ~|dO|·|v|, far below what an error in Δ's rounding gave (~1e-3).
          double largest = 0.0;
          for (float x : got[i].f32()) largest = std::max(largest, double(std::abs(x)));
          EXPECT_LE(largest, 1e-4) << names[i] << " at S 1";
        } else {
          EXPECT_LE(rel_err(got[i], want[i]), 3e-2) << names[i];
        }
      }
    }
}

// bf16 operands carry 8 significant bits (unit roundoff u = 2^-8 ≈ 3.9e-3). Each attention output
// passes through two or three rounded GEMM operands (q, k; then P and v; backward adds dO and dS),
// so errors of a few u relative to the tensor's largest value are expected; 3e-2 is ~8u and a
// broken kernel is off by O(1).
TEST(Ops, AttentionBf16CloseToCpu) {
  TPX_REQUIRE_GPU();
  check_attention({32, 2, 4, 8}, DType::bf16, 3e-2);
  check_attention({33, 2, 3, 16}, DType::bf16, 3e-2);
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding: the same fp32 table and the same rounded products and sums as the cpu, so
// the results are the same bits.

bool same_bits(const Tensor& got, const Tensor& want) {
  const Tensor g = on_cpu(got);
  auto gs = g.f32(), ws = want.f32();
  if (gs.size() != ws.size()) return false;
  for (std::size_t i = 0; i < gs.size(); ++i)
    if (std::bit_cast<std::uint32_t>(gs[i]) != std::bit_cast<std::uint32_t>(ws[i])) {
      ADD_FAILURE() << "element " << i << ": " << gs[i] << " vs " << ws[i];
      return false;
    }
  return true;
}

TEST(Ops, RopeIsBitIdenticalToCpu) {
  TPX_REQUIRE_GPU();
  struct Case {
    I s, b, heads, d;
    double theta;
  };
  for (const Case& c : {Case{77, 2, 3, 8, 10000.0}, Case{77, 2, 4, 64, 500000.0},
                        Case{300, 1, 2, 128, 500000.0}, Case{5, 3, 1, 2, 10000.0}}) {
    SCOPED_TRACE(testing::Message() << "S " << c.s << " B " << c.b << " heads " << c.heads << " D "
                                    << c.d << " theta " << c.theta);
    const Tensor x = random_tensor({c.s, c.b, c.heads * c.d}, 91, 0.0, 3.0);
    const Tensor g = on_gpu(x);
    // Twice each way: the second call reads the cached table.
    for (int round = 0; round < 2; ++round) {
      ops::rope_forward(x, c.heads, c.theta);
      ops::rope_forward(g, c.heads, c.theta);
      EXPECT_TRUE(same_bits(g, x)) << "forward, round " << round;
      ops::rope_backward(x, c.heads, c.theta);
      ops::rope_backward(g, c.heads, c.theta);
      EXPECT_TRUE(same_bits(g, x)) << "backward, round " << round;
    }
  }
}

// Several host threads, each on its own stream, asking at once for a table nobody has built:
// every one must see a complete table.
TEST(Ops, RopeFromSeveralThreadsAndStreams) {
  TPX_REQUIRE_GPU();
  constexpr int kThreads = 4;
  const I s = 129, b = 2, heads = 2, d = 32;
  const double theta = 31337.0;  // a table of its own
  const Tensor x = random_tensor({s, b, heads * d}, 92);
  const Tensor want = cpu_empty(x.shape());
  ops::copy(x, want);
  ops::rope_forward(want, heads, theta);
  std::vector<Tensor> got(kThreads);
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      try {
        Stream side = Stream::create(Device::cuda);
        cuda::StreamGuard on_side(side.native());
        const Tensor g = on_gpu(x);
        ops::rope_forward(g, heads, theta);
        got[std::size_t(t)] = on_cpu(g);
      } catch (const std::exception& e) {
        errors[std::size_t(t)] = e.what();
      }
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(errors[std::size_t(t)], "") << "thread " << t;
    EXPECT_TRUE(same_bits(got[std::size_t(t)], want)) << "thread " << t;
  }
}

TEST(Ops, RopeRefusesOddHeadDims) {
  TPX_REQUIRE_GPU();
  const Tensor g = on_gpu(random_tensor({4, 1, 6}, 93));
  EXPECT_THROW(ops::rope_forward(g, 2, 10000.0), Error);   // D = 3
  EXPECT_THROW(ops::rope_backward(g, 4, 10000.0), Error);  // 6 columns, 4 heads
  EXPECT_THROW(ops::rope_forward(g, 3, 0.0), Error);
}

// ---------------------------------------------------------------------------------------------
// Context parallelism's chunk pairs (stage 08): attention_block_forward, attention_merge and
// attention_block_backward on cuda against the cpu ops on the same inputs, used as the stage
// uses them: one query chunk meets several K/V chunks, each pair's (out, lse) is merged into the
// running (out, lse), then every pair's backward adds into the one dq and its own dk, dv.

/// lse [B, heads, S] against the cpu's: −inf (a query that saw no key) exactly where the cpu
/// has it, the finite values within tol of the largest |finite value|.
void expect_lse_near(const Tensor& got, const Tensor& want, double tol, const char* what) {
  const Tensor g = on_cpu(got);
  auto gs = g.f32(), ws = want.f32();
  ASSERT_EQ(gs.size(), ws.size()) << what;
  double err = 0.0, scale = 0.0;
  std::size_t unseen = 0;
  for (std::size_t i = 0; i < ws.size(); ++i) {
    if (std::isinf(ws[i])) {
      ++unseen;
      EXPECT_TRUE(std::isinf(gs[i]) && gs[i] < 0) << what << " row " << i << ": " << gs[i];
      continue;
    }
    err = std::isfinite(gs[i]) ? std::max(err, std::abs(double(gs[i]) - double(ws[i]))) : INFINITY;
    scale = std::max(scale, std::abs(double(ws[i])));
  }
  EXPECT_LE(scale > 0 ? err / scale : err, tol) << what << " (" << unseen << " rows see no key)";
}

struct PairCase {
  I s, b, heads, d, kv;
  std::vector<I> shifts;  ///< one K/V chunk per shift, keys `shift` rows before the queries
};

void check_chunk_pairs(const PairCase& c) {
  SCOPED_TRACE(testing::Message() << "pairs S " << c.s << " B " << c.b << " heads " << c.heads
                                  << " kv " << c.kv << " D " << c.d);
  // fp32 with the online softmax, as the fused kernels' test: 1e-4 of each tensor's largest
  // value (a wrong mask or a lost rescale is off by O(1)).
  constexpr double kTol = 1e-4;
  const Tensor::Shape act{c.s, c.b, c.heads * c.d}, kv_act{c.s, c.b, c.kv * c.d};
  const Tensor::Shape lse_shape{c.b, c.heads, c.s};
  const float inf = std::numeric_limits<float>::infinity();
  const Tensor q = random_tensor(act, 60), dout = random_tensor(act, 61);
  const Tensor gq = on_gpu(q), gdout = on_gpu(dout);
  std::vector<Tensor> ks, vs;
  Tensor out = cpu_empty(act), lse = cpu_empty(lse_shape);
  cpu::fill(out, 0.0f);
  cpu::fill(lse, -inf);
  const Tensor gout = on_gpu(out), glse = on_gpu(lse);
  for (std::size_t p = 0; p < c.shifts.size(); ++p) {
    const I shift = c.shifts[p];
    SCOPED_TRACE(testing::Message() << "shift " << shift);
    ks.push_back(random_tensor(kv_act, 62 + 2 * std::uint32_t(p)));
    vs.push_back(random_tensor(kv_act, 63 + 2 * std::uint32_t(p)));
    Tensor part_out = cpu_empty(act), part_lse = cpu_empty(lse_shape);
    cpu::attention_block_forward(q, ks[p], vs[p], c.heads, part_out, part_lse, shift);
    const Tensor gpart_out = gpu_empty(act), gpart_lse = gpu_empty(lse_shape);
    ops::fill(gpart_out, std::numeric_limits<float>::quiet_NaN());  // every element written
    ops::fill(gpart_lse, std::numeric_limits<float>::quiet_NaN());
    ops::attention_block_forward(gq, on_gpu(ks[p]), on_gpu(vs[p]), c.heads, gpart_out, gpart_lse,
                                 shift);
    EXPECT_LE(rel_err(gpart_out, part_out), kTol) << "pair out";
    expect_lse_near(gpart_lse, part_lse, kTol, "pair lse");
    // Merged with the cpu's own pair result on both sides: the merge alone is compared.
    cpu::attention_merge(out, lse, part_out, part_lse, c.heads);
    ops::attention_merge(gout, glse, on_gpu(part_out), on_gpu(part_lse), c.heads);
    EXPECT_LE(rel_err(gout, out), kTol) << "merged out";
    expect_lse_near(glse, lse, kTol, "merged lse");
  }
  // Backward of every pair from the merged (out, lse), the cpu's on both sides. The gradients
  // start from small random values (std 0.1, below the pairs' shares): the pairs add to them,
  // and an overwrite would be off by them.
  Tensor dq = random_tensor(act, 90, 0.0, 0.1);
  const Tensor gdq = on_gpu(dq);
  for (std::size_t p = 0; p < c.shifts.size(); ++p) {
    SCOPED_TRACE(testing::Message() << "backward, shift " << c.shifts[p]);
    Tensor dk = random_tensor(kv_act, 91 + std::uint32_t(p), 0.0, 0.1),
           dv = random_tensor(kv_act, 95 + std::uint32_t(p), 0.0, 0.1);
    const Tensor gdk = on_gpu(dk), gdv = on_gpu(dv);
    cpu::attention_block_backward(dout, q, ks[p], vs[p], out, lse, c.heads, dq, dk, dv,
                                  c.shifts[p]);
    ops::attention_block_backward(gdout, gq, on_gpu(ks[p]), on_gpu(vs[p]), on_gpu(out), on_gpu(lse),
                                  c.heads, gdq, gdk, gdv, c.shifts[p]);
    EXPECT_LE(rel_err(gdk, dk), kTol) << "dk";
    EXPECT_LE(rel_err(gdv, dv), kTol) << "dv";
    EXPECT_LE(rel_err(gdq, dq), kTol) << "dq so far";
  }
}

TEST(Ops, AttentionChunkPairsMatchCpu) {
  TPX_REQUIRE_GPU();
  // Shifts: 0 (the diagonal pair, masked), a partial overlap (13: the first queries see part of
  // the chunk, the last ones all of it), >= S (a chunk wholly in the past, unmasked), and a
  // negative one (the first queries see no key: out 0, lse −inf, skipped by the merge).
  check_chunk_pairs({40, 2, 4, 16, 4, {0, 13, 40, 95, -10}});
  // Grouped-query attention (3 query heads per KV head), S not a multiple of any tile.
  check_chunk_pairs({37, 1, 6, 32, 2, {37, 0, 20}});
  check_chunk_pairs({33, 2, 2, 64, 1, {-5, 33, 0}});
}

/// `t` (a cpu f32 tensor of bf16 values) as a bf16 tensor on the GPU.
Tensor gpu_bf16(const Tensor& t) {
  const Tensor b = Tensor::empty(t.shape(), DType::bf16, Device::cuda);
  ops::cast(on_gpu(t), b);
  return b;
}

/// Stage 08's pairs under --dtype bf16: bf16 q, k, v, dO and O as stored, fp32 partial outputs,
/// lse and gradients (added into). Against the cpu's fp32 pairs on the same bf16 values; the
/// GPU multiplies in bf16 (P and dS rounded to bf16, as the causal attention under bf16), so
/// 2e-2 of each tensor's largest value (the twin's bound; a wrong mask or shift is off by O(1)).
/// D 64: the tensor-core kernels; D 16: the CUDA-core ones on fp32 copies.
void check_bf16_chunk_pairs(const PairCase& c) {
  SCOPED_TRACE(testing::Message() << "bf16 pairs S " << c.s << " B " << c.b << " heads " << c.heads
                                  << " kv " << c.kv << " D " << c.d);
  constexpr double kTol = 2e-2;
  const Tensor::Shape act{c.s, c.b, c.heads * c.d}, kv_act{c.s, c.b, c.kv * c.d};
  const Tensor::Shape lse_shape{c.b, c.heads, c.s};
  const float inf = std::numeric_limits<float>::infinity();
  const Tensor q = rounded_to_bf16(random_tensor(act, 160)),
               dout = rounded_to_bf16(random_tensor(act, 161));
  std::vector<Tensor> ks, vs;
  Tensor out = cpu_empty(act), lse = cpu_empty(lse_shape);
  cpu::fill(out, 0.0f);
  cpu::fill(lse, -inf);
  for (std::size_t p = 0; p < c.shifts.size(); ++p) {
    const I shift = c.shifts[p];
    SCOPED_TRACE(testing::Message() << "shift " << shift);
    ks.push_back(rounded_to_bf16(random_tensor(kv_act, 162 + 2 * std::uint32_t(p))));
    vs.push_back(rounded_to_bf16(random_tensor(kv_act, 163 + 2 * std::uint32_t(p))));
    Tensor part_out = cpu_empty(act), part_lse = cpu_empty(lse_shape);
    cpu::attention_block_forward(q, ks[p], vs[p], c.heads, part_out, part_lse, shift);
    const Tensor gpart_out = gpu_empty(act), gpart_lse = gpu_empty(lse_shape);
    ops::fill(gpart_out, std::numeric_limits<float>::quiet_NaN());  // every element written
    ops::fill(gpart_lse, std::numeric_limits<float>::quiet_NaN());
    ops::attention_block_forward(gpu_bf16(q), gpu_bf16(ks[p]), gpu_bf16(vs[p]), c.heads, gpart_out,
                                 gpart_lse, shift);
    EXPECT_LE(rel_err(gpart_out, part_out), kTol) << "pair out";
    expect_lse_near(gpart_lse, part_lse, kTol, "pair lse");
    cpu::attention_merge(out, lse, part_out, part_lse, c.heads);
  }
  // The merged output as stage 08 stores it (bf16), read by both sides' backward.
  const Tensor out_b = rounded_to_bf16(out);
  Tensor dq = random_tensor(act, 190, 0.0, 0.1);
  const Tensor gdq = on_gpu(dq);
  for (std::size_t p = 0; p < c.shifts.size(); ++p) {
    SCOPED_TRACE(testing::Message() << "backward, shift " << c.shifts[p]);
    Tensor dk = random_tensor(kv_act, 191 + std::uint32_t(p), 0.0, 0.1),
           dv = random_tensor(kv_act, 195 + std::uint32_t(p), 0.0, 0.1);
    const Tensor gdk = on_gpu(dk), gdv = on_gpu(dv);
    cpu::attention_block_backward(dout, q, ks[p], vs[p], out_b, lse, c.heads, dq, dk, dv,
                                  c.shifts[p]);
    ops::attention_block_backward(gpu_bf16(dout), gpu_bf16(q), gpu_bf16(ks[p]), gpu_bf16(vs[p]),
                                  gpu_bf16(out_b), on_gpu(lse), c.heads, gdq, gdk, gdv,
                                  c.shifts[p]);
    EXPECT_LE(rel_err(gdk, dk), kTol) << "dk";
    EXPECT_LE(rel_err(gdv, dv), kTol) << "dv";
    EXPECT_LE(rel_err(gdq, dq), kTol) << "dq so far";
  }
}

TEST(Ops, AttentionBf16ChunkPairsMatchCpu) {
  TPX_REQUIRE_GPU();
  // Stage 08's shifts (0: the diagonal pair; S: a chunk wholly in the past), a partial overlap.
  check_bf16_chunk_pairs({40, 2, 4, 64, 2, {0, 40, 13}});  // tensor cores, GQA
  check_bf16_chunk_pairs({65, 1, 2, 128, 2, {65, 0}});     // tensor cores, S past a tile
  check_bf16_chunk_pairs({37, 2, 4, 16, 4, {0, 37, -5}});  // CUDA cores (D 16)
}

// The causal fused attention is the pair of shift 0, and backward's sum into zeros is the
// overwrite: one code path, the same bits.
TEST(Ops, AttentionChunkPairOfShiftZeroIsTheFusedKernel) {
  TPX_REQUIRE_GPU();
  const I s = 45, b = 2, heads = 4, d = 32, kv = 2;
  const Tensor::Shape act{s, b, heads * d}, kv_act{s, b, kv * d}, lse_shape{b, heads, s};
  const Tensor q = on_gpu(random_tensor(act, 70)), k = on_gpu(random_tensor(kv_act, 71)),
               v = on_gpu(random_tensor(kv_act, 72)), dout = on_gpu(random_tensor(act, 73));
  const Tensor out = gpu_empty(act), lse = gpu_empty(lse_shape);
  const Tensor dq = gpu_empty(act), dk = gpu_empty(kv_act), dv = gpu_empty(kv_act);
  ops::attention_fused_forward(q, k, v, heads, out, lse);
  ops::attention_fused_backward(dout, q, k, v, out, lse, heads, dq, dk, dv);
  const Tensor pout = gpu_empty(act), plse = gpu_empty(lse_shape);
  const Tensor pdq = gpu_empty(act), pdk = gpu_empty(kv_act), pdv = gpu_empty(kv_act);
  for (const Tensor* t : {&pdq, &pdk, &pdv}) ops::fill(*t, 0.0f);
  ops::attention_block_forward(q, k, v, heads, pout, plse, 0);
  ops::attention_block_backward(dout, q, k, v, out, lse, heads, pdq, pdk, pdv, 0);
  EXPECT_TRUE(same_bits(pout, on_cpu(out))) << "out";
  EXPECT_TRUE(same_bits(plse, on_cpu(lse))) << "lse";
  EXPECT_TRUE(same_bits(pdq, on_cpu(dq))) << "dq";
  EXPECT_TRUE(same_bits(pdk, on_cpu(dk))) << "dk";
  EXPECT_TRUE(same_bits(pdv, on_cpu(dv))) << "dv";
}

// AdamW: the same fp32 operations in the same order on both backends (no FMA contraction on
// either), so three steps leave the weights and both moments bit-identical.
TEST(Ops, AdamWIsBitIdenticalToCpu) {
  TPX_REQUIRE_GPU();
  // 4099: the scalar path (not a multiple of 4); 4096: the vector path, four elements a thread.
  // With and without the bf16 compute copy written in the same pass.
  for (const std::int64_t n : {4099, 4096})
    for (const bool with_copy : {false, true}) {
      const Tensor w = random_tensor({n}, 94), m = Tensor::empty({n}), v = Tensor::empty({n});
      ops::fill(m, 0.0f);
      ops::fill(v, 0.0f);
      const Tensor gw = on_gpu(w), gm = on_gpu(m), gv = on_gpu(v);
      const Tensor copy = with_copy ? Tensor::empty({n}, DType::bf16) : Tensor();
      const Tensor gcopy = with_copy ? Tensor::empty({n}, DType::bf16, Device::cuda) : Tensor();
      for (int t = 1; t <= 3; ++t) {
        const Tensor g = random_tensor({n}, std::uint32_t(95 + t), 0.0, 1e-2);
        const ops::AdamWStep s = test::adamw_step(1e-3, 0.9, 0.95, 1e-8, 0.1, t);
        ops::adamw_update(w, g, m, v, s, copy);
        ops::adamw_update(gw, on_gpu(g), gm, gv, s, gcopy);
      }
      const std::string what = "n " + std::to_string(n) + (with_copy ? " with copy" : "");
      EXPECT_TRUE(same_bits(on_cpu(gw), w)) << what;
      EXPECT_TRUE(same_bits(on_cpu(gm), m)) << what;
      EXPECT_TRUE(same_bits(on_cpu(gv), v)) << what;
      if (with_copy) {
        EXPECT_TRUE(same_bits(on_cpu(gcopy), copy)) << what;
      }
    }
}

TEST(Ops, PeakMeasurementIsPlausible) {
  TPX_REQUIRE_GPU();
  const double peak = ops::bf16_gemm_peak_tflops(Device::cuda);
  EXPECT_GT(peak, 1.0);      // any tensor-core GPU this code targets does far more
  EXPECT_LT(peak, 20000.0);  // and no GPU does this much
  EXPECT_EQ(ops::bf16_gemm_peak_tflops(Device::cuda), peak);  // measured once per process
}

// ---------------------------------------------------------------------------------------------
// FP8 GEMMs (stage 06): on FP8 tensor cores through cuBLASLt where the GPU has them (compute
// capability 8.9+), else the fallback that multiplies the dequantized operands in fp32. Both
// against the cpu: ops::gemm in fp32 of the operands dequantized on the cpu (q / scale).
//
// Error measure: |got − want| per element over bound = |alpha|·(|A|·|B|) + |beta|·|C₀| (of the
// dequantized values), the magnitude the sums pass through, so cancellation in a sum cannot
// shrink the yardstick. fp32 with unit roundoff u = 2⁻²⁴ ≈ 6e-8 then bounds the error rigorously:
//  - the cpu reference: dequantization, product, k−1 additions, alpha and beta, ≤ (k + 4)·u;
//  - the fallback: the same values (the casts are bit-identical), another summation order,
//    ≤ (k + 3)·u; so the two differ by at most (2k + 7)·u, 9e-6 at the largest k here (72);
//  - the tensor cores on integer codes (|q| ≤ 7): every product and partial sum is an integer below
//    2¹² (k·49 ≤ 3528), exact even in an adder that keeps only 13 bits, so the sum is exact and
//    only the scaling rounds: 1/scale_a, 1/scale_b, their product, alpha, beta·C, ≤ 7·u; with the
//    reference, (k + 11)·u, 5e-6.
// Hence 1e-5 for all of these. On data quantized from random values (codes over many binades)
// Hopper's tensor cores add FP8 products with fewer bits than fp32 inside an MMA (about 14, as
// reported for H800 in the DeepSeek-V3 technical report, §3.3.2) before cuBLASLt promotes the
// partial sums to fp32: 2⁻¹³ of the bound per addition at worst, a random walk of them in
// practice, so 2e-3 there; a transposed operand, a lost scale or beta, or garbage in the padding
// is off by O(1).

constexpr double kFp8TensorCoreTol = 2e-3;

/// A host FP8 tensor whose codes are the integers −7..7 (exact in e4m3 and e5m2), carrying the
/// given scale: element j stands for j / scale.
Tensor fp8_integers(Tensor::Shape shape, DType fmt, float scale, std::uint32_t seed) {
  Tensor x = random_tensor(shape, seed, 0.0, 4.0);
  for (float& v : x.f32()) v = std::min(std::max(std::nearbyint(v), -7.0f), 7.0f);
  Tensor one = cpu_empty({1}), s = cpu_empty({1});
  one.f32()[0] = 1.0f;
  s.f32()[0] = scale;
  Tensor q = Tensor::empty(std::move(shape), fmt);
  ops::quantize_fp8(x, one, q);  // x · 1 is an integer of the format: its code, exactly
  return q.with_scale(s);
}

/// Random normal values quantized by the recipe: scale = fmax / amax (not a power of two).
Tensor fp8_quantized(Tensor::Shape shape, DType fmt, std::uint32_t seed) {
  const Tensor x = random_tensor(shape, seed);
  Tensor amax = cpu_empty({1}), s = cpu_empty({1});
  ops::amax(x, amax);
  ops::fp8_scale(amax, fmt, s);
  Tensor q = Tensor::empty(std::move(shape), fmt);
  ops::quantize_fp8(x, s, q);
  return q.with_scale(s);
}

/// `t` copied to the GPU (an FP8 tensor with its scale); with `offset`, one element into a larger
/// buffer, so the data is only 1-byte (FP8) or 4-byte (f32) aligned.
Tensor to_gpu_at(const Tensor& t, bool offset) {
  const Tensor big = gpu_empty({t.numel() + 1}, t.dtype());
  const Tensor view = big.slice0(offset ? 1 : 0, t.numel() + (offset ? 1 : 0)).reshape(t.shape());
  ops::copy(t, view);
  return t.scale().defined() ? view.with_scale(on_gpu(t.scale())) : view;
}

Tensor dequantized_on_cpu(const Tensor& q) {
  Tensor x = cpu_empty(q.shape());
  ops::dequantize_fp8(q, q.scale(), x);
  return x;
}

Tensor abs_of(const Tensor& t) {
  Tensor r = cpu_empty(t.shape());
  auto in = t.f32(), out = r.f32();
  for (std::size_t i = 0; i < in.size(); ++i) out[i] = std::abs(in[i]);
  return r;
}

/// C = alpha·op(A)·op(B) + beta·C₀ for host FP8 operands, on the GPU through ops::gemm against
/// the cpu reference: returns max |got − want| / bound (see above).
double fp8_gemm_error(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c0,
                      float alpha, float beta, bool offset) {
  const Tensor da = dequantized_on_cpu(a), db = dequantized_on_cpu(b);
  Tensor want = cpu_empty(c0.shape()), bound = cpu_empty(c0.shape());
  ops::copy(c0, want);
  ops::gemm(da, ta, db, tb, want, alpha, beta);
  ops::copy(abs_of(c0), bound);
  ops::gemm(abs_of(da), ta, abs_of(db), tb, bound, std::abs(alpha), std::abs(beta));

  const Tensor got_gpu = to_gpu_at(c0, offset);
  ops::gemm(to_gpu_at(a, offset), ta, to_gpu_at(b, offset), tb, got_gpu, alpha, beta);
  const Tensor got = on_cpu(got_gpu);
  double worst = 0.0;
  auto g = got.f32(), w = want.f32(), bd = bound.f32();
  for (std::size_t i = 0; i < w.size(); ++i) {
    const double err = std::abs(double(g[i]) - double(w[i]));
    if (std::isnan(g[i])) return INFINITY;
    worst = std::max(worst, bd[i] > 0 ? err / double(bd[i]) : (err > 0 ? INFINITY : 0.0));
  }
  return worst;
}

struct Fp8Combo {
  DType a, b;
};
// The three products of the recipe (forward, dgrad, wgrad); cuBLASLt has no E5M2 × E5M2.
constexpr Fp8Combo kFp8Combos[] = {
    {DType::e4m3, DType::e4m3}, {DType::e5m2, DType::e4m3}, {DType::e4m3, DType::e5m2}};

struct Fp8Case {
  I m, n, k;
};
// k not a multiple of 16 (both operands packed, k padded with zeros); n not a multiple of 4 (C
// through a padded scratch); all aligned (C = A·Bᵀ runs in place). k·49 stays below 2¹².
constexpr Fp8Case kFp8Cases[] = {{37, 24, 40}, {33, 18, 64}, {48, 32, 72}};

/// Where this GPU's FP8 GEMMs run, for the traces.
const char* fp8_gemm_path() {
  return cuda::fp8_gemm_supported() ? "FP8 tensor cores (cuBLASLt)"
                                    : "dequantize + fp32 GEMM (GPU older than sm_89)";
}

TEST(Fp8CudaGemm, IntegerCodesEqualTheFp32GemmOfTheDequantizedOperands) {
  TPX_REQUIRE_GPU();
  SCOPED_TRACE(fp8_gemm_path());
  for (const Fp8Combo combo : kFp8Combos)
    for (const Fp8Case c : kFp8Cases)
      for (const bool ta : {false, true})
        for (const bool tb : {false, true})
          for (const bool offset : {false, true}) {
            SCOPED_TRACE(testing::Message() << to_string(combo.a) << " x " << to_string(combo.b)
                                            << " " << c.m << "x" << c.n << "x" << c.k << " ta "
                                            << ta << " tb " << tb << " offset " << offset);
            // Scales that are not powers of two, so 1/scale rounds.
            const Tensor a = fp8_integers(ta ? Tensor::Shape{c.k, c.m} : Tensor::Shape{c.m, c.k},
                                          combo.a, 0.37f, 20);
            const Tensor b = fp8_integers(tb ? Tensor::Shape{c.n, c.k} : Tensor::Shape{c.k, c.n},
                                          combo.b, 3.3f, 21);
            const Tensor c0 = random_tensor({c.m, c.n}, 22, 0.0, 10.0);
            EXPECT_LE(fp8_gemm_error(a, ta, b, tb, c0, 1.5f, 0.5f, offset), kF32Tol);
          }
}

TEST(Fp8CudaGemm, QuantizedDataIsCloseToTheFp32GemmOfTheDequantizedOperands) {
  TPX_REQUIRE_GPU();
  SCOPED_TRACE(fp8_gemm_path());
  const double tol = cuda::fp8_gemm_supported() ? kFp8TensorCoreTol : kF32Tol;
  for (const Fp8Combo combo : kFp8Combos)
    for (const Fp8Case c : kFp8Cases)
      for (const bool ta : {false, true})
        for (const bool tb : {false, true}) {
          SCOPED_TRACE(testing::Message()
                       << to_string(combo.a) << " x " << to_string(combo.b) << " " << c.m << "x"
                       << c.n << "x" << c.k << " ta " << ta << " tb " << tb);
          const Tensor a =
              fp8_quantized(ta ? Tensor::Shape{c.k, c.m} : Tensor::Shape{c.m, c.k}, combo.a, 23);
          const Tensor b =
              fp8_quantized(tb ? Tensor::Shape{c.n, c.k} : Tensor::Shape{c.k, c.n}, combo.b, 24);
          const Tensor c0 = random_tensor({c.m, c.n}, 25);
          EXPECT_LE(fp8_gemm_error(a, ta, b, tb, c0, 1.0f, -0.75f, false), tol);
        }
}

TEST(Fp8CudaGemm, E5M2TimesE5M2MultipliesTheDequantizedOperands) {
  TPX_REQUIRE_GPU();
  // Not in cuBLASLt's FP8 table: the dequantizing path on every GPU, so fp32 accuracy.
  for (const bool ta : {false, true}) {
    SCOPED_TRACE(testing::Message() << "ta " << ta);
    const Tensor a =
        fp8_quantized(ta ? Tensor::Shape{40, 21} : Tensor::Shape{21, 40}, DType::e5m2, 26);
    const Tensor b = fp8_quantized({40, 12}, DType::e5m2, 27);
    const Tensor c0 = random_tensor({21, 12}, 28);
    EXPECT_LE(fp8_gemm_error(a, ta, b, false, c0, 0.5f, 1.0f, false), kF32Tol);
  }
}

// The recipes' quantizer on the device (common/cuda/lowp.cu) writes the cpu's lowp::quantize's
// bytes, and its dequantizer reads lowp::dequantize's values back: every recipe and operand role, on matrices with partial blocks, a zero block and fp32
// subnormals, once plain and once with a block of one huge value, a NaN and an infinity (which
// make nvfp4's tensor scale 1); nvfp4 also under a given (agreed) tensor amax twice the plain
// matrix's own.
TEST(LowpCuda, QuantizerWritesTheCpusBytes) {
  TPX_REQUIRE_GPU();
  using lowp::Operand;
  using lowp::Recipe;
  for (const auto& [rows, cols] : {std::pair<I, I>{37, 300}, {130, 256}})
    for (const bool specials : {false, true}) {
      Tensor host = cpu_empty({rows, cols});
      const std::span<float> x = host.f32();
      for (std::size_t i = 0; i < x.size(); ++i)
        x[i] = std::sin(0.37f * float(i)) * std::exp2(float(int(i % 23) - 11));
      for (I c = 0; c < 32; ++c) x[std::size_t(c)] = 0.0f;  // a zero 32-block of row 0
      for (I c = 0; c < 16; ++c)
        x[std::size_t(2 * cols + c)] = 1.0e-40f * float(c + 1);  // fp32 subnormals in row 2
      if (specials) {
        x[std::size_t(cols + 5)] = 3.0e38f;  // one huge value in row 1
        x[std::size_t(3 * cols + 7)] = std::numeric_limits<float>::quiet_NaN();
        x[std::size_t(4 * cols + 9)] = -std::numeric_limits<float>::infinity();
      }
      float own = 0.0f;
      for (const float v : x) own = std::max(own, std::fabs(v));
      const Tensor xg = on_gpu(host);
      for (const Recipe r :
           {Recipe::tensorwise, Recipe::rowwise, Recipe::block128, Recipe::mxfp8, Recipe::nvfp4})
        for (const Operand op : {Operand::activation, Operand::weight, Operand::gradient})
          for (const bool agreed : {false, true}) {
            if (agreed && (r != Recipe::nvfp4 || specials)) continue;
            SCOPED_TRACE(fmt::format("{} operand {} {}x{}{}{}", lowp::to_string(r), int(op), rows,
                                     cols, specials ? " specials" : "",
                                     agreed ? " agreed amax" : ""));
            const float given = 2.0f * own;
            const lowp::Quantized want = agreed ? lowp::quantize(x.data(), rows, cols, r, op, given)
                                                : lowp::quantize(x.data(), rows, cols, r, op);
            const lowp::Layout l = lowp::layout(r, op);
            const bool fp32 = l.scale == lowp::ScaleFormat::fp32;
            const Tensor codes = gpu_empty({rows, cols}, DType::u8);
            const Tensor scales =
                gpu_empty({want.scale_rows, want.scale_cols}, fp32 ? DType::f32 : DType::u8);
            const Tensor tensor_scale = gpu_empty({1});
            Tensor amax;
            if (agreed) {
              Tensor a = cpu_empty({1});
              a.f32()[0] = given;
              amax = on_gpu(a);
            }
            cuda::lowp_quantize(xg, l, amax, codes, scales, tensor_scale);
            const Tensor got_codes = on_cpu(codes), got_scales = on_cpu(scales);
            const std::uint8_t* gc = got_codes.data<std::uint8_t>();
            EXPECT_EQ(std::vector<std::uint8_t>(gc, gc + want.codes.size()), want.codes);
            if (fp32) {
              const std::span<const float> gs = got_scales.f32();
              for (std::size_t i = 0; i < want.scales.size(); ++i)
                EXPECT_EQ(std::bit_cast<std::uint32_t>(gs[i]),
                          std::bit_cast<std::uint32_t>(want.scales[i]))
                    << "scale " << i;
            } else {
              const std::uint8_t* gs = got_scales.data<std::uint8_t>();
              EXPECT_EQ(std::vector<std::uint8_t>(gs, gs + want.scale_codes.size()),
                        want.scale_codes);
            }
            if (r == Recipe::nvfp4) {
              EXPECT_EQ(on_cpu(tensor_scale).f32()[0], want.tensor_scale);
            }
            // And back: the values lowp::dequantize reads from the same codes, bit for bit.
            const Tensor back = gpu_empty({rows, cols});
            cuda::lowp_dequantize(codes, l, scales, tensor_scale, back);
            const std::vector<float> want_back = lowp::dequantize(want);
            const Tensor got_back = on_cpu(back);
            const std::span<const float> gb = got_back.f32();
            I differ = 0;
            for (std::size_t i = 0; i < want_back.size(); ++i)
              differ +=
                  std::bit_cast<std::uint32_t>(gb[i]) != std::bit_cast<std::uint32_t>(want_back[i]);
            EXPECT_EQ(differ, 0) << "dequantized values differ";
          }
    }
}

// The ops stage 06's recipes are written in (06_fp8/recipes.cc), on the device against the cpu,
// bit for bit: ops::lowp_quantize with an agreed amax (the path that fills a device scalar) and
// e4m3 codes, lowp_dequantize, the Hadamard transform over 37 rows (two whole groups and a
// partial one) with subnormals, nvfp4's stochastic rounding of a gradient, transpose of 4-, 2- and
// 1-byte elements, E2M1 packing both ways.
TEST(LowpCuda, RecipeOpsEqualTheCpusOps) {
  TPX_REQUIRE_GPU();
  const I rows = 37, cols = 64;
  Tensor x = cpu_empty({rows, cols});
  for (std::size_t i = 0; i < x.f32().size(); ++i)
    x.f32()[i] = std::cos(1.3f * float(i)) * (i % 17 == 0 ? 1.0e-39f : 3.0f);
  const Tensor xg = on_gpu(x);
  auto same_bytes = [](const Tensor& cpu, const Tensor& gpu, const char* what) {
    const Tensor back = on_cpu(gpu);
    ASSERT_EQ(back.nbytes(), cpu.nbytes()) << what;
    EXPECT_EQ(std::memcmp(back.raw(), cpu.raw(), cpu.nbytes()), 0) << what;
  };
  for (const lowp::Recipe r : {lowp::Recipe::rowwise, lowp::Recipe::mxfp8, lowp::Recipe::nvfp4}) {
    SCOPED_TRACE(std::string(lowp::to_string(r)));
    const lowp::Layout l = lowp::layout(r, lowp::Operand::activation);
    const bool fp32 = l.scale == lowp::ScaleFormat::fp32;
    const I sc = l.block_cols == 0 ? 1 : (cols + l.block_cols - 1) / l.block_cols;
    const DType code_dtype = r == lowp::Recipe::nvfp4 ? DType::u8 : DType::e4m3;
    const DType scale_dtype = fp32 ? DType::f32 : DType::u8;
    const Tensor c_cpu = Tensor::empty({rows, cols}, code_dtype);
    const Tensor s_cpu = Tensor::empty({rows, sc}, scale_dtype), t_cpu = cpu_empty({1});
    const Tensor c_gpu = gpu_empty({rows, cols}, code_dtype);
    const Tensor s_gpu = gpu_empty({rows, sc}, scale_dtype), t_gpu = gpu_empty({1});
    ops::lowp_quantize(x, r, lowp::Operand::activation, 7.5f, c_cpu, s_cpu, t_cpu);
    ops::lowp_quantize(xg, r, lowp::Operand::activation, 7.5f, c_gpu, s_gpu, t_gpu);
    same_bytes(c_cpu, c_gpu, "codes");
    same_bytes(s_cpu, s_gpu, "scales");
    if (r == lowp::Recipe::nvfp4) same_bytes(t_cpu, t_gpu, "tensor scale");
    const Tensor d_cpu = cpu_empty({rows, cols}), d_gpu = gpu_empty({rows, cols});
    ops::lowp_dequantize(c_cpu, s_cpu, t_cpu, r, lowp::Operand::activation, d_cpu);
    ops::lowp_dequantize(c_gpu, s_gpu, t_gpu, r, lowp::Operand::activation, d_gpu);
    same_bytes(d_cpu, d_gpu, "dequantized");
  }
  {  // nvfp4's stochastic rounding of a gradient: the same random bits, the same codes
    const lowp::StochasticRounding sr{.stream = 77, .token0 = 3, .feature0 = 16, .k_rows = true};
    const Tensor c_cpu = Tensor::empty({rows, cols}, DType::u8);
    const Tensor s_cpu = Tensor::empty({rows, cols / 16}, DType::u8), t_cpu = cpu_empty({1});
    const Tensor c_gpu = gpu_empty({rows, cols}, DType::u8);
    const Tensor s_gpu = gpu_empty({rows, cols / 16}, DType::u8), t_gpu = gpu_empty({1});
    ops::lowp_quantize(x, lowp::Recipe::nvfp4, lowp::Operand::gradient, std::nullopt, c_cpu, s_cpu,
                       t_cpu, &sr);
    ops::lowp_quantize(xg, lowp::Recipe::nvfp4, lowp::Operand::gradient, std::nullopt, c_gpu, s_gpu,
                       t_gpu, &sr);
    same_bytes(c_cpu, c_gpu, "stochastically rounded codes");
  }
  const Tensor h_cpu = cpu_empty({rows, cols}), h_gpu = gpu_empty({rows, cols});
  ops::hadamard_rows(x, h_cpu);
  ops::hadamard_rows(xg, h_gpu);
  same_bytes(h_cpu, h_gpu, "hadamard_rows");
  for (const DType d : {DType::f32, DType::bf16, DType::u8}) {
    Tensor src = Tensor::empty({rows, cols}, d, Device::cpu);
    auto* bytes = static_cast<std::uint8_t*>(src.raw());
    for (std::size_t i = 0; i < src.nbytes(); ++i) bytes[i] = std::uint8_t(i * 37 + 11);
    const Tensor t_cpu = Tensor::empty({cols, rows}, d, Device::cpu);
    const Tensor t_gpu = Tensor::empty({cols, rows}, d, Device::cuda);
    ops::transpose(src, t_cpu);
    ops::transpose(ops::to_device(src, Device::cuda), t_gpu);
    const Tensor back = Tensor::empty({cols, rows}, d, Device::cpu);
    ops::copy(t_gpu, back);
    EXPECT_EQ(std::memcmp(back.raw(), t_cpu.raw(), t_cpu.nbytes()), 0) << to_string(d);
  }
  Tensor codes = Tensor::empty({rows, cols}, DType::u8, Device::cpu);
  for (I i = 0; i < codes.numel(); ++i) codes.data<std::uint8_t>()[i] = std::uint8_t((i * 7) & 0xF);
  const Tensor p_cpu = Tensor::empty({rows, cols / 2}, DType::u8, Device::cpu);
  const Tensor p_gpu = gpu_empty({rows, cols / 2}, DType::u8);
  ops::pack_e2m1(codes, p_cpu);
  ops::pack_e2m1(ops::to_device(codes, Device::cuda), p_gpu);
  same_bytes(p_cpu, p_gpu, "packed");
  const Tensor u_gpu = gpu_empty({rows, cols}, DType::u8);
  ops::unpack_e2m1(p_gpu, u_gpu);
  same_bytes(codes, u_gpu, "unpacked");
}

// Stage 10's MoE ops on the device against the cpu's: the routing and the row moves the same
// bytes (moe_token.h: the same function on both sides, no FMA; combine_rows one rounding per
// product and per sum in j order), the gate weights' and the router's gradients to rounding.
TEST(MoeCuda, RoutingAndRowMovesEqualTheCpusOps) {
  TPX_REQUIRE_GPU();
  const I n = 300, E = 16, k = 4, H = 96, R = 500;
  auto same_bytes = [](const Tensor& cpu, const Tensor& gpu, const char* what) {
    const Tensor back = on_cpu(gpu);
    ASSERT_EQ(back.nbytes(), cpu.nbytes()) << what;
    EXPECT_EQ(std::memcmp(back.raw(), cpu.raw(), cpu.nbytes()), 0) << what;
  };
  Tensor logits = cpu_empty({n, E}), bias = cpu_empty({E});
  for (std::size_t i = 0; i < logits.f32().size(); ++i)
    logits.f32()[i] = i % 7 == 0 ? 0.25f : std::sin(0.37f * float(i)) * 3.0f;  // ties too
  for (I e = 0; e < E; ++e) bias.f32()[std::size_t(e)] = e % 3 == 0 ? 0.01f : 0.0f;
  for (const bool sigmoid : {false, true}) {
    SCOPED_TRACE(sigmoid ? "sigmoid" : "softmax");
    const Tensor sc = cpu_empty({n, E}), wc = cpu_empty({n, k});
    const Tensor ec = Tensor::empty({n, k}, DType::i32);
    const Tensor sg = gpu_empty({n, E}), wg = gpu_empty({n, k});
    const Tensor eg = gpu_empty({n, k}, DType::i32);
    ops::moe_route(logits, bias, sigmoid, sc, ec, wc);
    ops::moe_route(on_gpu(logits), on_gpu(bias), sigmoid, sg, eg, wg);
    same_bytes(sc, sg, "score");
    same_bytes(ec, eg, "expert");
    same_bytes(wc, wg, "weight");
    // The router's gradient: close (its sums may fuse on the device).
    Tensor dweight = cpu_empty({n, k}), dP = cpu_empty({E});
    for (std::size_t i = 0; i < dweight.f32().size(); ++i)
      dweight.f32()[i] = std::cos(0.11f * float(i));
    for (I e = 0; e < E; ++e) dP.f32()[std::size_t(e)] = 0.01f * float(e + 1);
    const Tensor dzc = cpu_empty({n, E}), dzg = gpu_empty({n, E});
    ops::moe_router_dz(sc, ec, wc, dweight, dP, sigmoid, 4 * n, dzc);
    ops::moe_router_dz(sg, eg, wg, on_gpu(dweight), on_gpu(dP), sigmoid, 4 * n, dzg);
    EXPECT_LT(rel_err(dzg, dzc), kF32Tol);
  }
  const Tensor x = random_tensor({n, H}, 5), rows = random_tensor({R, H}, 6);
  Tensor index = Tensor::empty({R}, DType::i32), slot = Tensor::empty({n, k}, DType::i32);
  Tensor scale = random_tensor({R}, 7), weight = random_tensor({n, k}, 8);
  for (I i = 0; i < R; ++i) index.data<std::int32_t>()[i] = std::int32_t((i * 37) % n);
  for (I a = 0; a < n * k; ++a)
    slot.data<std::int32_t>()[a] = a % 5 == 0 ? -1 : std::int32_t((a * 11) % R);
  const Tensor gc = cpu_empty({R, H}), gg = gpu_empty({R, H});
  ops::gather_rows(x, index, scale, gc);
  ops::gather_rows(on_gpu(x), on_gpu(index), on_gpu(scale), gg);
  same_bytes(gc, gg, "gather_rows");
  const Tensor yc = random_tensor({n, H}, 9), yg = on_gpu(yc);
  ops::combine_rows(rows, slot, weight, yc, /*accumulate=*/true);
  ops::combine_rows(on_gpu(rows), on_gpu(slot), on_gpu(weight), yg, /*accumulate=*/true);
  same_bytes(yc, yg, "combine_rows");
  const Tensor dc = cpu_empty({n, k}), dg = gpu_empty({n, k});
  ops::rows_dot(x, rows, slot, dc);
  ops::rows_dot(on_gpu(x), on_gpu(rows), on_gpu(slot), dg);
  EXPECT_LT(rel_err(dg, dc), kF32Tol);
}

// ops::gemm_scaled on the device against its dequantized product on the cpu (the same codes and
// scales, made on the device), for rowwise and block128, on the column forward's pair (an
// activation against a weight), the dgrad's (a gradient against a weight) and the weight
// gradient's (an activation against a gradient), at shapes that need no padding, padding of K to
// whole blocks and of m and n to 4, and a K of one block. Each element may differ from the cpu's
// by 1e-3 of Σ|terms| (the probe's bound, common/scaled_gemm_plan.h). On a Hopper GPU with
// cuBLASLt 12.9+ (ops::scaled_gemm_problem empty) every one of these must run natively: stderr
// must carry no fallback line, and the probe's line must name the orders it chose. Elsewhere the
// fallback runs, says so, and must still agree. rowwise's two gradients (E5M2 x E5M2) are refused
// by the plan in one line and multiplied dequantized.
TEST(LowpCuda, NativeScaledGemmMatchesTheDequantizedProduct) {
  TPX_REQUIRE_GPU();
  using lowp::Operand;
  using lowp::Recipe;
  struct Shape {
    I m, n, k;
  };
  const Shape shapes[] = {{256, 256, 384}, {37, 50, 200}, {128, 96, 130}, {64, 128, 128}};
  auto quantized = [](const Tensor& x, Recipe r, Operand o) {
    const lowp::Layout l = lowp::layout(r, o);
    const I rows = x.dim(0), cols = x.dim(1);
    const I br = l.block_rows == 0 ? rows : l.block_rows;
    const I bc = l.block_cols == 0 ? cols : l.block_cols;
    const DType code =
        l.element.mantissa_bits == fp8::kE5M2.mantissa_bits ? DType::e5m2 : DType::e4m3;
    ops::ScaledOperand q{.codes = gpu_empty({rows, cols}, code),
                         .scales = gpu_empty({(rows + br - 1) / br, (cols + bc - 1) / bc}),
                         .tensor_scale = gpu_empty({1}),
                         .recipe = r,
                         .operand = o,
                         .transposed = false,
                         .values = Tensor()};
    ops::lowp_quantize(x, r, o, std::nullopt, q.codes, q.scales, q.tensor_scale);
    return q;
  };
  auto host = [](ops::ScaledOperand q) {
    q.codes = on_cpu(q.codes);
    q.scales = on_cpu(q.scales);
    q.tensor_scale = on_cpu(q.tensor_scale);
    return q;
  };
  const bool native = ops::scaled_gemm_problem(Device::cuda, Recipe::rowwise).empty();
  std::cout << "native block-scaled GEMMs: "
            << (native ? std::string("yes")
                       : ops::scaled_gemm_problem(Device::cuda, Recipe::rowwise))
            << "\n";
  for (const Recipe r : {Recipe::rowwise, Recipe::block128})
    for (const auto& [oa, ob] : {std::pair{Operand::activation, Operand::weight},
                                 std::pair{Operand::gradient, Operand::weight},
                                 std::pair{Operand::activation, Operand::gradient}})
      for (const Shape& sh : shapes) {
        SCOPED_TRACE(fmt::format("{} m={} n={} k={} operands {} {}", lowp::to_string(r), sh.m, sh.n,
                                 sh.k, int(oa), int(ob)));
        // Rows of different magnitudes, so that the per-row and per-block scales differ.
        Tensor xa = cpu_empty({sh.m, sh.k}), xb = cpu_empty({sh.n, sh.k});
        for (I i = 0; i < xa.numel(); ++i)
          xa.f32()[std::size_t(i)] = std::sin(0.61f * float(i)) * float(1 + (i / sh.k) % 9) *
                                     (1.0f + float((i % sh.k) / 128));
        for (I i = 0; i < xb.numel(); ++i)
          xb.f32()[std::size_t(i)] = std::cos(0.29f * float(i)) * float(1 + (i / sh.k) % 5) * 0.02f;
        const ops::ScaledOperand a = quantized(on_gpu(xa), r, oa), b = quantized(on_gpu(xb), r, ob);
        const Tensor c = gpu_empty({sh.m, sh.n});
        testing::internal::CaptureStderr();
        ops::gemm_scaled(a, b, c);
        ops::synchronize(Device::cuda);
        const std::string said = testing::internal::GetCapturedStderr();
        const Tensor want = cpu_empty({sh.m, sh.n});
        ops::gemm_scaled(host(a), host(b), want);
        // Σ|terms|: the dequantized operands' magnitudes multiplied.
        auto magnitudes = [](const ops::ScaledOperand& q) {
          const Tensor x = cpu_empty(q.codes.shape());
          ops::lowp_dequantize(q.codes, q.scales, q.tensor_scale, q.recipe, q.operand, x);
          for (float& v : x.f32()) v = std::fabs(v);
          return x;
        };
        const Tensor mag = cpu_empty({sh.m, sh.n});
        ops::gemm(magnitudes(host(a)), false, magnitudes(host(b)), true, mag);
        const Tensor got = on_cpu(c);
        I bad = 0;
        for (std::size_t i = 0; i < got.f32().size(); ++i)
          bad += !(std::fabs(got.f32()[i] - want.f32()[i]) <= 1e-3f * mag.f32()[i] + 1e-30f);
        EXPECT_EQ(bad, 0) << "elements off by more than 1e-3 of their terms' magnitude";
        if (native) {
          EXPECT_EQ(said.find("dequantized"), std::string::npos) << said;
        }
        if (native && said.find("checked by the probe") != std::string::npos) std::cout << said;
      }
  // rowwise's two gradients: refused by the plan, said once, multiplied dequantized.
  const Tensor g = random_tensor({64, 128}, 5);
  const ops::ScaledOperand ga = quantized(on_gpu(g), Recipe::rowwise, Operand::gradient);
  const Tensor c = gpu_empty({64, 64});
  testing::internal::CaptureStderr();
  ops::gemm_scaled(ga, ga, c);
  ops::gemm_scaled(ga, ga, c);
  const std::string said = testing::internal::GetCapturedStderr();
  // On another GPU the plan's first refusal is the GPU's; either way one line for the shape.
  const std::string why = native ? "E5M2 x E5M2" : "multiplying the dequantized operands";
  EXPECT_NE(said.find(why), std::string::npos) << said;
  EXPECT_EQ(said.find(why), said.rfind(why)) << "said once: " << said;
  const Tensor want = cpu_empty({64, 64});
  ops::gemm_scaled(host(ga), host(ga), want);
  const Tensor got = on_cpu(c);
  for (std::size_t i = 0; i < got.f32().size(); ++i)
    EXPECT_NEAR(got.f32()[i], want.f32()[i], 1e-4f * (1.0f + std::fabs(want.f32()[i])));
}

}  // namespace
}  // namespace tpx
