// GEMM throughput at the block's shapes: for each weight kind the forward product y = x·W and
// the two backward products dx = dy·Wᵀ and dW = xᵀ·dy, in fp32 and (cuda) bf16 with fp32
// accumulation. Reports TFLOP/s (2·m·n·k per GEMM); --benchmark_out=FILE
// --benchmark_out_format=json writes Google Benchmark's JSON.
//
//   build/bin/bench_gemm [--benchmark_filter=cuda/bf16] [--benchmark_min_time=0.5]
#include <benchmark/benchmark.h>

#include <chrono>
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
};

/// The products of one linear layer with weight [in, out] over T tokens.
std::vector<GemmShape> linear_gemms(const std::string& layer, I t, I in, I out) {
  return {{layer + "/fwd", t, out, in, false, false},  // y[T,out] = x[T,in]·W[in,out]
          {layer + "/dx", t, in, out, false, true},    // dx[T,in] = dy[T,out]·Wᵀ
          {layer + "/dw", in, out, t, true, false}};   // dW[in,out] = xᵀ·dy
}

void bm_gemm(benchmark::State& state, Device d, DType compute, GemmShape g) {
  const Tensor a = random_on(d, g.ta ? Tensor::Shape{g.k, g.m} : Tensor::Shape{g.m, g.k}, 1);
  const Tensor b = random_on(d, g.tb ? Tensor::Shape{g.n, g.k} : Tensor::Shape{g.k, g.n}, 2);
  const Tensor c = Tensor::empty({g.m, g.n}, DType::f32, d);
  double seconds = 0.0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    ops::gemm(a, g.ta, b, g.tb, c, 1.0f, 0.0f, compute);
    ops::synchronize(d);  // device GEMMs are asynchronous: time them to completion
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double flops = 2.0 * double(g.m) * double(g.n) * double(g.k);
  state.counters["TFLOP/s"] = seconds > 0 ? flops * double(state.iterations()) / seconds / 1e12 : 0;
  state.SetLabel(fmt::format("m={} n={} k={}", g.m, g.n, g.k));
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
    benchmark::AddCustomContext(fmt::format("tpx_device_{}", to_string(d)), device_label(d));
    for (DType t : types)
      for (const GemmShape& g : shapes)
        benchmark::RegisterBenchmark(
            fmt::format("gemm/{}/{}/{}", to_string(d), to_string(t), g.name).c_str(),
            [d, t, g](benchmark::State& s) { bm_gemm(s, d, t, g); })
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace
}  // namespace tpx::bench

int main(int argc, char** argv) {
  return tpx::bench::run_benchmarks(argc, argv, tpx::bench::register_all);
}
