// Causal attention, forward + backward, fused (FlashAttention-2) against naive (probabilities
// materialised): on the cpu at S = 1024 (B 2, NH 8, D 32: the default config's heads), and on
// cuda when a GPU is usable in bf16 at S = 1024, 2048, 8192 and 16384 with D = 128 (NH 32, B 1:
// Llama-2-7B's heads), and at S = 2048 with D = 64 (NH 32). The naive path stops at S = 8192:
// its probabilities and their gradient are S² floats per head each, 25 GiB of peak at 8192 and
// four times that at 16384, more than an 80 GB GPU holds. On cuda the fused kernels' forward and
// backward are also timed apart at S = 2048 and 8192 (rows fused-fwd, fused-bwd).
//
// Counters: TFLOP/s, and peak_MiB, the allocator's high-water mark above the inputs during one
// forward + backward (outputs, what forward keeps, the backward's scratch). The cpu's block
// buffers live outside the allocator: the naive backward's dS matrix (S² floats, 4 MiB at
// S = 1024) and the fused kernels' two 128×128 score blocks and one float per row (about
// 0.13 MiB); the label states them.
//
// Timing: only the attention calls, on the stage's operand type (bf16 tensors in and out on
// cuda, made before the clock starts: no cast and no allocation is timed), by device events
// around timed_reps() calls back to back on cuda (ops::time_ms) and the host clock on the cpu.
//
// FLOP convention (FlashAttention-2's, arXiv:2307.08691 §4.1): the forward is two GEMMs of
// 2·S²·D per (batch, head), halved by the causal mask: 4·B·NH·S²·D / 2; the backward counts
// 2.5× the forward (five GEMM-sized products instead of two); a step is 3.5× the forward. The
// recomputation of the probabilities in backward is not counted as useful work, and the naive
// path, which multiplies the full S×S matrices, is credited with the same causal count.
//
//   build/bin/bench_attention [--benchmark_filter=cpu] [--benchmark_out=F
//   --benchmark_out_format=json]
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "bench_util.h"

namespace tpx::bench {
namespace {

using I = std::int64_t;

struct AttnShape {
  I s, b, heads, d;
};

/// What a row times: the training step's attention (forward + backward), or, for the fused
/// kernels on cuda, the forward or the backward alone (the backward from a forward done before
/// the clock starts): where the step's time goes, beside SDPA's same split (tools/sdpa_bench.py).
enum class Pass { step, forward, backward };

/// Causal FLOPs of `pass` under the convention above.
double pass_flops(const AttnShape& a, Pass pass) {
  const double forward =
      4.0 * double(a.b) * double(a.heads) * double(a.s) * double(a.s) * double(a.d) / 2.0;
  return pass == Pass::forward ? forward : pass == Pass::backward ? 2.5 * forward : 3.5 * forward;
}

/// q, k, v, dout as the stage hands them to attention: bf16 under bf16 compute (so no cast runs
/// inside the clock), fp32 otherwise; make_outputs() adds out, dq, dk, dv of the same type.
struct AttnTensors {
  Device device;
  DType type;
  Tensor::Shape act;
  Tensor q, k, v, dout, out, dq, dk, dv;
  AttnTensors(Device d, DType compute, const AttnShape& a)
      : device(d),
        type(compute == DType::bf16 ? DType::bf16 : DType::f32),
        act{a.s, a.b, a.heads * a.d},
        q(as_dtype(random_on(d, act, 1), type)),
        k(as_dtype(random_on(d, act, 2), type)),
        v(as_dtype(random_on(d, act, 3), type)),
        dout(as_dtype(random_on(d, act, 4), type)) {}
  void make_outputs() {
    out = Tensor::empty(act, type, device);
    dq = Tensor::empty(act, type, device);
    dk = Tensor::empty(act, type, device);
    dv = Tensor::empty(act, type, device);
  }
};

/// The fused kernels' forward or backward alone, on cuda.
void bm_fused_pass(benchmark::State& state, DType compute, Pass pass, AttnShape a) {
  constexpr Device d = Device::cuda;
  AttnTensors t(d, compute, a);
  t.make_outputs();
  const Tensor lse = Tensor::empty({a.b, a.heads, a.s}, DType::f32, d);
  ops::attention_fused_forward(t.q, t.k, t.v, a.heads, t.out, lse, compute);  // backward reads it
  double seconds = 0.0;
  for (auto _ : state) {
    const double ms = ops::time_ms(d, timed_reps(d), [&] {
      if (pass == Pass::forward)
        ops::attention_fused_forward(t.q, t.k, t.v, a.heads, t.out, lse, compute);
      else
        ops::attention_fused_backward(t.dout, t.q, t.k, t.v, t.out, lse, a.heads, t.dq, t.dk, t.dv,
                                      compute);
    });
    state.SetIterationTime(ms * 1e-3);
    seconds += ms * 1e-3;
  }
  const double iters = double(state.iterations());
  state.counters["TFLOP/s"] = seconds > 0 ? pass_flops(a, pass) * iters / seconds / 1e12 : 0;
  state.SetLabel(fmt::format("S={} B={} NH={} D={}", a.s, a.b, a.heads, a.d));
}

void bm_attention(benchmark::State& state, Device d, DType compute, bool fused, AttnShape a) {
  AttnTensors t(d, compute, a);
  Allocator& alloc = allocator_for(d);
  ops::synchronize(d);
  const std::size_t before = alloc.stats().current;  // the inputs; what follows is the peak's
  alloc.reset_peak();
  t.make_outputs();
  const Tensor lse = Tensor::empty({a.b, a.heads, a.s}, DType::f32, d);
  const Tensor probs = fused ? Tensor() : Tensor::empty({a.b, a.heads, a.s, a.s}, DType::f32, d);
  double seconds = 0.0;
  for (auto _ : state) {
    const double ms = ops::time_ms(d, timed_reps(d), [&] {
      if (fused) {
        ops::attention_fused_forward(t.q, t.k, t.v, a.heads, t.out, lse, compute);
        ops::attention_fused_backward(t.dout, t.q, t.k, t.v, t.out, lse, a.heads, t.dq, t.dk, t.dv,
                                      compute);
      } else {
        ops::attention_forward(t.q, t.k, t.v, a.heads, t.out, probs, compute);
        ops::attention_backward(t.dout, t.q, t.k, t.v, probs, a.heads, t.dq, t.dk, t.dv, compute);
      }
    });
    state.SetIterationTime(ms * 1e-3);
    seconds += ms * 1e-3;
  }
  const double iters = double(state.iterations());
  state.counters["TFLOP/s"] = seconds > 0 ? pass_flops(a, Pass::step) * iters / seconds / 1e12 : 0;
  state.counters["peak_MiB"] = double(alloc.stats().peak - before) / (1024.0 * 1024.0);
  const double host_mib =
      d == Device::cpu
          ? (fused ? double(2 * 128 * 128 + a.s) * 4 : double(a.s * a.s) * 4) / (1024.0 * 1024.0)
          : 0.0;
  state.SetLabel(fmt::format(
      "S={} B={} NH={} D={}{}", a.s, a.b, a.heads, a.d,
      d == Device::cpu ? fmt::format(" host scratch {:.2f} MiB", host_mib) : std::string()));
}

void register_all() {
  for (Device d : devices()) {
    benchmark::AddCustomContext(fmt::format("tpx_device_{}", to_string(d)), device_label(d));
    const DType compute = d == Device::cuda ? DType::bf16 : DType::f32;
    std::vector<AttnShape> shapes;
    if (d == Device::cpu)
      shapes = {{1024, 2, 8, 32}};
    else
      shapes = {{1024, 1, 32, 128},
                {2048, 1, 32, 128},
                {8192, 1, 32, 128},
                {16384, 1, 32, 128},
                {2048, 1, 32, 64}};
    constexpr std::int64_t kNaiveMaxSeq = 8192;  // S² scratch beyond it outgrows the GPU
    for (const AttnShape& a : shapes)
      for (const bool fused : {true, false}) {
        if (!fused && d == Device::cuda && a.s > kNaiveMaxSeq) continue;
        // The D = 128 rows keep the names of earlier runs; another head dim says so.
        const std::string head_dim =
            a.d == 128 || d == Device::cpu ? "" : fmt::format("/D:{}", a.d);
        benchmark::RegisterBenchmark(
            fmt::format("attention/{}/{}/{}/S:{}{}", to_string(d), dtype_flag(compute),
                        fused ? "fused" : "naive", a.s, head_dim)
                .c_str(),
            [d, compute, fused, a](benchmark::State& s) { bm_attention(s, d, compute, fused, a); })
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
    if (d != Device::cuda) continue;
    for (const std::int64_t seq : {2048, 8192})
      for (const Pass pass : {Pass::forward, Pass::backward}) {
        const AttnShape a{seq, 1, 32, 128};
        benchmark::RegisterBenchmark(
            fmt::format("attention/cuda/{}/fused-{}/S:{}", dtype_flag(compute),
                        pass == Pass::forward ? "fwd" : "bwd", seq)
                .c_str(),
            [compute, pass, a](benchmark::State& s) { bm_fused_pass(s, compute, pass, a); })
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
  }
}

}  // namespace
}  // namespace tpx::bench

int main(int argc, char** argv) {
  return tpx::bench::run_benchmarks(argc, argv, tpx::bench::register_all);
}
