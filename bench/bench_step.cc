// One full training step of the block (stage 01, one layer): forward, loss, backward and the SGD
// update, as tpx::train runs it. Reports TFLOP/s from common/flops.h (GEMM FLOPs of forward +
// backward) and, on cuda, MFU against the measured bf16 GEMM peak. --benchmark_out=FILE
// --benchmark_out_format=json writes Google Benchmark's JSON.
//
//   build/bin/bench_step [--benchmark_filter=cuda] [--benchmark_min_time=2]
#include <benchmark/benchmark.h>

#include <chrono>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "01_baseline/layers.h"
#include "bench_util.h"
#include "common/block.h"
#include "common/flops.h"
#include "common/model.h"

namespace tpx::bench {
namespace {

void bm_step(benchmark::State& state, BlockConfig c) {
  baseline::SerialLinears par(c.dtype);
  Model m = make_model(c, par.sharding());
  std::vector<BlockActivations> acts(static_cast<std::size_t>(c.layers));
  const double count = double(c.seq) * double(c.batch) * double(c.hidden);
  double seconds = 0.0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    Tensor y = m.input;
    for (std::size_t l = 0; l < acts.size(); ++l)
      y = block_forward(c, m.params[l], y, par, acts[l]);
    Tensor dy = Tensor::empty(y.shape(), y.dtype(), y.device());
    benchmark::DoNotOptimize(ops::mse_loss_sum(y, m.target));
    ops::mse_loss_backward(y, m.target, 1.0 / count, dy);
    for (std::size_t l = acts.size(); l-- > 0;)
      dy = block_backward(c, m.params[l], acts[l], dy, par, m.grads[l]);
    // A tiny learning rate keeps the weights (and so the work) the same from step to step.
    for (std::size_t l = 0; l < acts.size(); ++l)
      for (Param p : kAllParams) ops::sgd_update(m.params[l][p], m.grads[l][p], 1e-9f);
    ops::synchronize(c.device);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double tflops =
      seconds > 0 ? step_flops(c).total() * double(state.iterations()) / seconds / 1e12 : 0.0;
  state.counters["TFLOP/s"] = tflops;
  if (c.device == Device::cuda) {
    const double peak = ops::bf16_gemm_peak_tflops(c.device);
    state.counters["bf16_peak_TFLOP/s"] = peak;
    state.counters["MFU_%"] = 100.0 * tflops / peak;
  }
  state.SetLabel(fmt::format("H={} NH={} F={} S={} B={} L={}", c.hidden, c.heads, c.ffn, c.seq,
                             c.batch, c.layers));
}

void register_all() {
  for (Device d : devices()) {
    std::vector<DType> types{DType::f32};
    if (d == Device::cuda) types.push_back(DType::bf16);
    benchmark::AddCustomContext(fmt::format("tpx_device_{}", to_string(d)), device_label(d));
    for (DType t : types) {
      BlockConfig c = bench_config(d);
      c.dtype = t;
      benchmark::RegisterBenchmark(fmt::format("step/{}/{}", to_string(d), to_string(t)).c_str(),
                                   [c](benchmark::State& s) { bm_step(s, c); })
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace
}  // namespace tpx::bench

int main(int argc, char** argv) {
  return tpx::bench::run_benchmarks(argc, argv, tpx::bench::register_all);
}
