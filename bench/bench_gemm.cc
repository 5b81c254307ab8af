// GEMM throughput at the block's shapes: for each weight kind the forward product y = x·W and
// the two backward products dx = dy·Wᵀ and dW = xᵀ·dy, in fp32, (cuda) bf16 in and out with fp32
// accumulation, and fp8 as stage 06 multiplies them (forward E4M3 × E4M3, dx E5M2 × E4M3, dW
// E4M3 × E5M2, operands quantized with their per-tensor scales and laid out K-major before the
// timing starts; fp32 out). Only the product is timed: on cuda by device events around
// timed_reps() calls back to back (ops::time_ms), on the cpu by the host clock. On the
// cpu an FP8 GEMM dequantizes its operands and runs the fp32 GEMM: its numbers show what the
// emulation costs, not FP8 speed. Reports TFLOP/s (2·m·n·k per GEMM); --benchmark_out=FILE
// --benchmark_out_format=json writes Google Benchmark's JSON.
//
// Chunked GEMMs (gemm_chunked/<device>/<dtype>/<gemm>/N:<n>, n = 2 … 8): the forward GEMMs of
// wq, w_gate and w_down as one GEMM of M = T rows, and as n GEMMs of M/n rows each (the first
// M mod n chunks one row taller), each timed to completion: what the ring of stage 04 and the
// pulls of stage 05 do to a GEMM. Counters: efficiency = time of the one GEMM / sum of the n chunk
// times (≤ about 1: the loss of splitting), TFLOP/s of the chunked run; the reported time is the
// chunked run's.
//
//   build/bin/bench_gemm [--benchmark_filter=cuda/bf16] [--benchmark_min_time=0.5]
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "bench_util.h"

namespace tpx::bench {
namespace {

using I = std::int64_t;

struct GemmShape {
  std::string name;
  I m, n, k;
  bool ta, tb;
  DType fp8_a, fp8_b;  // the operands' formats under stage 06's recipe
};

/// The products of one linear layer with weight [in, out] over T tokens.
std::vector<GemmShape> linear_gemms(const std::string& layer, I t, I in, I out) {
  constexpr DType e4m3 = DType::e4m3, e5m2 = DType::e5m2;
  return {{layer + "/fwd", t, out, in, false, false, e4m3, e4m3},  // y[T,out] = x[T,in]·W[in,out]
          {layer + "/dx", t, in, out, false, true, e5m2, e4m3},    // dx[T,in] = dy[T,out]·Wᵀ
          {layer + "/dw", in, out, t, true, false, e4m3, e5m2}};   // dW[in,out] = xᵀ·dy
}

/// x in `format` with its per-tensor scale (fmax / amax), as stage 06 quantizes an operand.
Tensor quantized(const Tensor& x, DType format) {
  const Tensor amax = Tensor::empty({1}, DType::f32, x.device());
  const Tensor scale = Tensor::empty({1}, DType::f32, x.device());
  const Tensor q = Tensor::empty(x.shape(), format, x.device());
  ops::amax(x, amax);
  ops::fp8_scale(amax, format, scale);
  ops::quantize_fp8(x, scale, q);
  return q.with_scale(scale);
}

/// compute: f32, bf16, or e4m3 for stage 06's FP8 operands. Only the product is timed: a bf16
/// row's operands are bf16 tensors and it writes bf16 (no cast inside the clock); an FP8 row's
/// codes are quantized before it and laid out K-major, A [m, k] and B [n, k], the "TN" form
/// cuBLASLt's FP8 GEMM reads in place (common/fp8_gemm_plan.h), so no transpose is timed either
/// (stage 06 makes those transposes; they are not GEMM time).
void bm_gemm(benchmark::State& state, Device d, DType compute, GemmShape g) {
  const bool fp8 = is_fp8(compute);
  const bool ta = fp8 ? false : g.ta, tb = fp8 ? true : g.tb;
  Tensor a = random_on(d, ta ? Tensor::Shape{g.k, g.m} : Tensor::Shape{g.m, g.k}, 1);
  Tensor b = random_on(d, tb ? Tensor::Shape{g.n, g.k} : Tensor::Shape{g.k, g.n}, 2);
  DType out = DType::f32;
  if (fp8) {
    a = quantized(a, g.fp8_a);
    b = quantized(b, g.fp8_b);
    compute = DType::f32;  // not used for FP8 operands
  } else if (compute == DType::bf16) {
    a = as_dtype(a, DType::bf16);
    b = as_dtype(b, DType::bf16);
    out = DType::bf16;
  }
  const Tensor c = Tensor::empty({g.m, g.n}, out, d);
  double seconds = 0.0;
  for (auto _ : state) {
    const double ms =
        ops::time_ms(d, timed_reps(d), [&] { ops::gemm(a, ta, b, tb, c, 1.0f, 0.0f, compute); });
    state.SetIterationTime(ms * 1e-3);
    seconds += ms * 1e-3;
  }
  const double flops = 2.0 * double(g.m) * double(g.n) * double(g.k);
  state.counters["TFLOP/s"] = seconds > 0 ? flops * double(state.iterations()) / seconds / 1e12 : 0;
  state.SetLabel(fmt::format("m={} n={} k={}", g.m, g.n, g.k));
}

/// The forward GEMM `g` whole and in `chunks` row chunks; see the top of the file.
void bm_gemm_chunked(benchmark::State& state, Device d, DType compute, GemmShape g, I chunks) {
  const Tensor a = as_dtype(random_on(d, {g.m, g.k}, 1), compute);
  const Tensor b = as_dtype(random_on(d, {g.k, g.n}, 2), compute);
  const Tensor c = Tensor::empty({g.m, g.n}, compute, d);
  auto timed = [d](auto&& work) { return ops::time_ms(d, timed_reps(d), work) * 1e-3; };
  double whole = 0.0, chunked = 0.0;
  for (auto _ : state) {
    whole += timed([&] { ops::gemm(a, false, b, false, c, 1.0f, 0.0f, compute); });
    double sum = 0.0;
    for (I i = 0, row = 0; i < chunks; ++i) {
      const I rows = g.m / chunks + (i < g.m % chunks ? 1 : 0);
      const Tensor ai = a.slice0(row, row + rows), ci = c.slice0(row, row + rows);
      sum += timed([&] { ops::gemm(ai, false, b, false, ci, 1.0f, 0.0f, compute); });
      row += rows;
    }
    state.SetIterationTime(sum);
    chunked += sum;
  }
  const double flops = 2.0 * double(g.m) * double(g.n) * double(g.k);
  state.counters["efficiency"] = chunked > 0 ? whole / chunked : 0;
  state.counters["TFLOP/s"] = chunked > 0 ? flops * double(state.iterations()) / chunked / 1e12 : 0;
  state.SetLabel(fmt::format("m={} n={} k={} chunks={}", g.m, g.n, g.k, chunks));
}

void register_all() {
  for (Device d : devices()) {
    const BlockConfig c = bench_config(d);
    std::vector<GemmShape> shapes;
    for (auto [layer, in, out] :
         {std::tuple{"wq", c.hidden, c.hidden}, std::tuple{"w_gate", c.hidden, c.ffn},
          std::tuple{"w_down", c.ffn, c.hidden}})
      for (auto& g : linear_gemms(layer, c.tokens(), in, out)) shapes.push_back(g);
    std::vector<DType> types{DType::f32};
    if (d == Device::cuda) types.push_back(DType::bf16);
    types.push_back(DType::e4m3);  // "fp8": the recipe's formats per product
    benchmark::AddCustomContext(fmt::format("tpx_device_{}", to_string(d)), device_label(d));
    for (DType t : types)
      for (const GemmShape& g : shapes)
        benchmark::RegisterBenchmark(
            fmt::format("gemm/{}/{}/{}", to_string(d), dtype_flag(t), g.name).c_str(),
            [d, t, g](benchmark::State& s) { bm_gemm(s, d, t, g); })
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond);
    std::vector<DType> chunked_types{DType::f32};
    if (d == Device::cuda) chunked_types = {DType::bf16};
    for (DType t : chunked_types)
      for (const GemmShape& g : shapes) {
        if (!g.name.ends_with("/fwd")) continue;
        const std::string gemm = g.name.substr(0, g.name.size() - 4);
        for (I n = 2; n <= 8; ++n)
          benchmark::RegisterBenchmark(
              fmt::format("gemm_chunked/{}/{}/{}/N:{}", to_string(d), dtype_flag(t), gemm, n)
                  .c_str(),
              [d, t, g, n](benchmark::State& s) { bm_gemm_chunked(s, d, t, g, n); })
              ->UseManualTime()
              ->Unit(benchmark::kMicrosecond);
      }
  }
}

}  // namespace
}  // namespace tpx::bench

int main(int argc, char** argv) {
  return tpx::bench::run_benchmarks(argc, argv, tpx::bench::register_all);
}
