// Shared pieces of the benchmark programs: which devices can run here, the block sizes each device
// is benchmarked at, and device tensors filled with random values.
//
// Sizes: the cpu runs the tutorial's default config (small, so CI can run it; cpu timings show
// the mechanics, not GPU speed); the gpu runs H=4096, NH=32, F=11008, S=2048, B=1, a Llama-7B-
// sized block, where GEMMs dominate.
//
// defines: tpx::bench::devices(), bench_config(), random_on(), as_dtype(), timed_reps(),
//          device_label(), run_benchmarks()
#pragma once

#include <benchmark/benchmark.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/ops.h"
#include "common/tensor.h"

namespace tpx::bench {

/// cpu, plus cuda when a GPU is usable (a note on stderr says why not otherwise).
inline std::vector<Device> devices() {
  std::vector<Device> d{Device::cpu};
  if (const auto why = ops::device_problem(Device::cuda); why.empty())
    d.push_back(Device::cuda);
  else
    std::fprintf(stderr, "note: no cuda benchmarks: %s\n", why.c_str());
  return d;
}

inline BlockConfig bench_config(Device d) {
  BlockConfig c;  // the default config on the cpu
  c.device = d;
  if (d == Device::cuda) {
    c.hidden = 4096;
    c.heads = 32;
    c.ffn = 11008;
    c.seq = 2048;
    c.batch = 1;
  }
  c.layers = 1;
  return c;
}

/// A tensor on `d` with N(0, std²) values (fixed seed).
inline Tensor random_on(Device d, Tensor::Shape shape, unsigned seed, double std = 1.0) {
  Tensor host = Tensor::empty(std::move(shape));
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, static_cast<float>(std));
  for (float& v : host.f32()) v = dist(gen);
  return d == Device::cpu ? host : ops::to_device(host, d);
}

/// `t` as a tensor of `dtype` on its device (a copy; t itself when it already is one): the
/// operands a bf16 benchmark row reads, made before its clock starts.
inline Tensor as_dtype(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  Tensor out = Tensor::empty(t.shape(), dtype, t.device());
  ops::cast(t, out);
  return out;
}

/// Calls of the timed work per benchmark iteration: on cuda enough back to back that the
/// host's launches run ahead of the GPU (device events time them: ops::time_ms), one on the cpu.
inline int timed_reps(Device d) {
  return d == Device::cuda ? 10 : 1;
}

/// "cpu" or the GPU's name, for benchmark labels and the JSON context.
inline std::string device_label(Device d) {
  return ops::device_name(d);
}

/// The programs' main(): Google Benchmark's flags, then `register_all` adds the benchmarks for the
/// devices usable here (they are registered at run time because that depends on the machine).
template <class Register>
int run_benchmarks(int argc, char** argv, Register register_all) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace tpx::bench
