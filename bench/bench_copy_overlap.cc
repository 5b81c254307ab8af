// Copy/compute contention: how much a GEMM slows down while a transfer of the same number of
// bytes runs beside it, moved by different movers. Overlapping communication with compute (the
// ring of stage 04) hides the transfer only if the transfer does not take what the GEMM needs.
//
// What is measured. Each benchmark times one square GEMM C[n, n] = A[n, n]·B[n, n] (n is the
// benchmark's argument) alone first, then once per iteration with a mover copying bytes for the
// whole time the GEMM runs. The reported time is the contended GEMM's; the counters are
//   gemm_ms          the GEMM alone (the median of at least 5 runs and 50 ms after a warm-up,
//                    taken before the contended runs in the same benchmark)
//   slowdown         mean contended GEMM time / gemm_ms
//   copy_GBps        bytes the mover copied per second while the GEMM ran (every byte is read
//                    once and written once: the memory traffic is twice this)
//   copy_alone_GBps  the same mover with nothing beside it
//   bytes            the size of one transfer
// The GEMM is compute-bound (2n³ flops on 3n² values), so a mover that only takes memory
// bandwidth should barely slow it; what slows it is losing compute units.
//
// Transfer size: the GEMM's operand bytes, A + B + C (fp32: 12n²; bf16 operands with an fp32 C:
// 8n²): one GEMM's worth of data, the order of what a ring step moves beside the GEMM it hides
// behind. The mover repeats the transfer until the GEMM is over.
//
// The movers, cuda (bf16 and fp32 GEMMs, n = 4096 and 8192, on the default stream; the mover on a
// created stream beside it; both timed with events):
//   none         the GEMM alone again (slowdown ≈ 1: the noise floor)
//   copy_engine  cudaMemcpyAsync device to device: carried out by a copy engine, a DMA unit
//                beside the SMs (Nsight Systems shows it as a memcpy, not a kernel). The GEMM keeps
//                every SM; the two share only HBM bandwidth.
//   sm_copy      a grid-stride copy kernel (copy_kernel.cu) on 32 blocks, the order of NCCL's
//                channel count. Its blocks hold their SMs for as long as the copy runs, so the
//                GEMM runs on the SMs left, and shares bandwidth besides.
//   nccl         ncclSend + ncclRecv to itself in one group on a one-rank communicator (builds
//                with NCCL only). NCCL moves the bytes with its own kernel: it takes SMs like
//                sm_copy, with NCCL's choice of blocks. This is why copy-engine communication
//                (symmetric memory, copy-engine all-gathers) matters for overlap.
// The mover's transfers are issued before the GEMM and calibrated to outlast it (checked every
// iteration, doubled when they do not). copy_GBps counts the part of each transfer that falls
// inside the GEMM's window, taking each transfer to move its bytes at an even rate.
//
// The movers, cpu (fp32, n = 256 and 512):
//   none         as on cuda
//   copy_thread  a created tpx::Stream (a thread of its own) memcpy-ing the buffer in 64 KiB
//                pieces until the GEMM is over: the stand-in for a DMA engine. With
//                OPENBLAS_NUM_THREADS=1 on a machine of two or more cores the copy thread has a
//                core to itself, so what it contends for is caches and memory bandwidth, not
//                compute units: cpu numbers show the mechanics of the measurement, not GPU
//                behaviour. (Let OpenBLAS use every core and the copy thread takes cycles from the
//                GEMM: the cpu's picture of sm_copy.) On a machine busy with other work the
//                copy thread may not get a core while the GEMM runs: copy_GBps near 0 says so.
//
//   OPENBLAS_NUM_THREADS=1 build/bin/bench_copy_overlap [--benchmark_filter=cuda/bf16]
//       [--benchmark_min_time=0.5]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "bench_util.h"
#include "common/check.h"
#include "common/stream.h"

#if TPX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "common/cuda/check.h"
#include "common/cuda/device.h"
#endif
#if TPX_WITH_NCCL
#include <nccl.h>

#include "common/cuda/nccl_check.h"
#endif

namespace tpx::bench {

#if TPX_WITH_CUDA
/// copy_kernel.cu: copies `bytes` from src to dst with `blocks` blocks on `stream` (a
/// cudaStream_t); returns the launch's cudaError_t.
int launch_sm_copy(const void* src, void* dst, std::size_t bytes, int blocks, void* stream);
#endif

namespace {

using I = std::int64_t;
using Clock = std::chrono::steady_clock;

enum class Mover { none, copy_thread, copy_engine, sm_copy, nccl };

std::string_view mover_name(Mover m) {
  switch (m) {
    case Mover::none:
      return "none";
    case Mover::copy_thread:
      return "copy_thread";
    case Mover::copy_engine:
      return "copy_engine";
    case Mover::sm_copy:
      return "sm_copy";
    case Mover::nccl:
      return "nccl";
  }
  return "?";
}

constexpr std::size_t kAloneRuns = 5;   // at least this many runs timed alone,
constexpr double kAloneSeconds = 0.05;  // and at least this long; their median is reported
constexpr std::size_t kCpuPiece = std::size_t{64} << 10;  // the copy thread's unit of work

/// The median of `timed()` (one run's seconds) over at least kAloneRuns runs and kAloneSeconds.
template <class Timed>
double median_alone(Timed timed) {
  std::vector<double> runs;
  double total = 0.0;
  while (runs.size() < kAloneRuns || total < kAloneSeconds) {
    runs.push_back(timed());
    total += runs.back();
  }
  const auto mid = runs.begin() + static_cast<std::ptrdiff_t>(runs.size() / 2);
  std::nth_element(runs.begin(), mid, runs.end());
  return *mid;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// What the contended iterations add up.
struct Totals {
  double gemm_s = 0.0;  // contended GEMM time
  double moved = 0.0;   // bytes the mover copied while the GEMM ran
};

void report(benchmark::State& state, I n, double alone_s, const Totals& t, double copy_alone_bps,
            std::size_t bytes) {
  const double iterations = static_cast<double>(state.iterations());
  state.counters["gemm_ms"] = alone_s * 1e3;
  state.counters["slowdown"] = iterations > 0 && alone_s > 0 ? t.gemm_s / iterations / alone_s : 0;
  state.counters["copy_GBps"] = t.gemm_s > 0 ? t.moved / t.gemm_s / 1e9 : 0;
  state.counters["copy_alone_GBps"] = copy_alone_bps / 1e9;
  state.counters["bytes"] = benchmark::Counter(
      static_cast<double>(bytes), benchmark::Counter::kDefaults, benchmark::Counter::OneK::kIs1024);
  state.SetLabel(fmt::format("m=n=k={}", n));
}

// cpu ---------------------------------------------------------------------------------------------

/// A copy loop running on `lane` (a created cpu stream) from construction until stop(): memcpy of
/// src into dst, kCpuPiece bytes at a time, round and round. The constructor returns once the
/// loop has copied its first piece (so it runs when the GEMM starts); the destructor stops it, so
/// the task never outlives the state it shares.
class CopyThread {
 public:
  CopyThread(const Stream& lane, const Tensor& src, const Tensor& dst) : lane_(lane) {
    lane_.run([this, src, dst] {
      const auto* from = static_cast<const std::byte*>(src.raw());
      auto* to = static_cast<std::byte*>(dst.raw());
      const std::size_t total = src.nbytes();
      for (std::size_t at = 0; !stop_.load(std::memory_order_relaxed);) {
        const std::size_t piece = std::min(kCpuPiece, total - at);
        std::memcpy(to + at, from + at, piece);
        moved_.fetch_add(piece, std::memory_order_relaxed);
        at = at + piece == total ? 0 : at + piece;
      }
    });
    while (moved() == 0) std::this_thread::yield();
  }
  ~CopyThread() {
    try {
      stop();
    } catch (const std::exception& e) {
      fmt::print(stderr, "copy thread: {}\n", e.what());
    }
  }
  CopyThread(const CopyThread&) = delete;
  CopyThread& operator=(const CopyThread&) = delete;

  /// Bytes copied so far.
  std::uint64_t moved() const { return moved_.load(std::memory_order_relaxed); }
  /// Ends the loop and waits for it; rethrows a failure of the lane.
  void stop() {
    stop_.store(true, std::memory_order_relaxed);
    lane_.synchronize();
  }

 private:
  Stream lane_;
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> moved_{0};
};

void bm_cpu(benchmark::State& state, Mover mover) {
  const I n = state.range(0);
  const Tensor a = random_on(Device::cpu, {n, n}, 1);
  const Tensor b = random_on(Device::cpu, {n, n}, 2);
  const Tensor c = Tensor::empty({n, n});
  const std::size_t bytes = a.nbytes() + b.nbytes() + c.nbytes();
  const auto gemm = [&] { ops::gemm(a, false, b, false, c); };

  gemm();  // warm-up: OpenBLAS's buffers, C's pages
  const double alone = median_alone([&] {
    const auto t0 = Clock::now();
    gemm();
    return seconds_since(t0);
  });

  // The mover's buffers (filled so that their pages exist before anything is timed).
  const Tensor src = Tensor::empty({static_cast<I>(bytes / sizeof(float))});
  const Tensor dst = Tensor::empty({static_cast<I>(bytes / sizeof(float))});
  ops::fill(src, 1.0f);
  ops::fill(dst, 0.0f);
  const Stream lane = Stream::create(Device::cpu);
  double copy_alone_bps = 0.0;
  if (mover == Mover::copy_thread) {  // the copy thread alone, for about one GEMM's time
    CopyThread copy(lane, src, dst);
    const std::uint64_t m0 = copy.moved();
    const auto t0 = Clock::now();
    std::this_thread::sleep_for(std::chrono::duration<double>(std::max(alone, 2e-3)));
    const std::uint64_t m1 = copy.moved();
    copy_alone_bps = static_cast<double>(m1 - m0) / seconds_since(t0);
  }

  Totals totals;
  for (auto _ : state) {
    std::optional<CopyThread> copy;
    if (mover == Mover::copy_thread) copy.emplace(lane, src, dst);
    const std::uint64_t m0 = copy ? copy->moved() : 0;
    const auto t0 = Clock::now();
    gemm();
    const double s = seconds_since(t0);
    const std::uint64_t m1 = copy ? copy->moved() : 0;
    if (copy) copy->stop();
    state.SetIterationTime(s);
    totals.gemm_s += s;
    totals.moved += static_cast<double>(m1 - m0);
  }
  report(state, n, alone, totals, copy_alone_bps, bytes);
}

// cuda --------------------------------------------------------------------------------------------
#if TPX_WITH_CUDA

constexpr int kSmCopyBlocks = 32;     // sm_copy's blocks (clamped to the SM count)
constexpr int kMaxRepeats = 1 << 16;  // transfers one contended iteration may issue
constexpr double kOutlast = 3.0;      // first guess: transfers for kOutlast GEMMs' time

/// The GEMM operands of each (n, compute) pair, made once per program run: random values for n =
/// 8192 take seconds on the host, and Google Benchmark calls a benchmark several times.
class CudaOperands {
 public:
  /// A and B, [n, n] on cuda: fp32, or bf16 when `compute` is bf16 (so the GEMM casts nothing).
  const std::pair<Tensor, Tensor>& get(I n, DType compute) {
    auto it = cache_.find({n, compute});
    if (it == cache_.end())
      it =
          cache_.emplace(std::pair{n, compute}, std::pair{make(n, compute, 1), make(n, compute, 2)})
              .first;
    return it->second;
  }

 private:
  static Tensor make(I n, DType compute, unsigned seed) {
    const Tensor f = random_on(Device::cuda, {n, n}, seed);
    if (compute == DType::f32) return f;
    const Tensor h = Tensor::empty({n, n}, DType::bf16, Device::cuda);
    ops::cast(f, h);
    return h;
  }
  std::map<std::pair<I, DType>, std::pair<Tensor, Tensor>> cache_;
};

/// Timing events (cudaEventCreate's default flags), created on demand, destroyed with the pool.
class TimingEvents {
 public:
  TimingEvents() = default;
  ~TimingEvents() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  TimingEvents(const TimingEvents&) = delete;
  TimingEvents& operator=(const TimingEvents&) = delete;

  /// Makes sure there are at least `count` events.
  void reserve(std::size_t count) {
    while (events_.size() < count) {
      cudaEvent_t e = nullptr;
      TPX_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
  }
  cudaEvent_t operator[](std::size_t i) const { return events_.at(i); }

 private:
  std::vector<cudaEvent_t> events_;
};

/// Milliseconds from `from` to `to`, both completed.
double ms_between(cudaEvent_t from, cudaEvent_t to) {
  float ms = 0.0f;
  TPX_CUDA_CHECK(cudaEventElapsedTime(&ms, from, to));
  return static_cast<double>(ms);
}

#if TPX_WITH_NCCL
/// A one-rank NCCL communicator: sends to itself go through NCCL's kernels like any other peer's.
class SelfComm {
 public:
  SelfComm() {
    ncclUniqueId id{};
    TPX_NCCL_CHECK(ncclGetUniqueId(&id));
    TPX_NCCL_CHECK(ncclCommInitRank(&comm_, 1, id, 0));
  }
  ~SelfComm() {
    if (comm_) ncclCommDestroy(comm_);
  }
  SelfComm(const SelfComm&) = delete;
  SelfComm& operator=(const SelfComm&) = delete;
  ncclComm_t get() const { return comm_; }

 private:
  ncclComm_t comm_ = nullptr;
};
#endif

/// One mover on a created stream of its own: issue() enqueues one transfer of `bytes` from a
/// source buffer into a destination buffer.
class CudaMover {
 public:
  CudaMover(Mover kind, std::size_t bytes)
      : kind_(kind),
        bytes_(bytes),
        lane_(Stream::create(Device::cuda)),
        src_(Tensor::empty({static_cast<I>(bytes / sizeof(float))}, DType::f32, Device::cuda)),
        dst_(Tensor::empty({static_cast<I>(bytes / sizeof(float))}, DType::f32, Device::cuda)),
        blocks_(std::min(kSmCopyBlocks, cuda::device_info().sm_count)) {
    TPX_CHECK(bytes % 16 == 0, "the transfer ({} bytes) must be whole 16-byte words", bytes);
    ops::fill(src_, 1.0f);
    ops::fill(dst_, 0.0f);
    cuda::synchronize();  // the fills ran on the default stream
    record_stream(src_, lane_);
    record_stream(dst_, lane_);
#if TPX_WITH_NCCL
    if (kind == Mover::nccl) comm_ = std::make_unique<SelfComm>();
#endif
  }
  ~CudaMover() {
    try {
      lane_.synchronize();
    } catch (const std::exception& e) {
      fmt::print(stderr, "cuda mover: {}\n", e.what());
    }
  }
  CudaMover(const CudaMover&) = delete;
  CudaMover& operator=(const CudaMover&) = delete;

  cudaStream_t stream() const {
    return static_cast<cudaStream_t>(lane_.native());
  }

  void issue() const {
    switch (kind_) {
      case Mover::copy_engine:
        TPX_CUDA_CHECK(
            cudaMemcpyAsync(dst_.raw(), src_.raw(), bytes_, cudaMemcpyDeviceToDevice, stream()));
        return;
      case Mover::sm_copy:
        TPX_CUDA_CHECK(launch_sm_copy(src_.raw(), dst_.raw(), bytes_, blocks_, lane_.native()));
        return;
      case Mover::nccl:
#if TPX_WITH_NCCL
        TPX_NCCL_CHECK(ncclGroupStart());
        TPX_NCCL_CHECK(ncclSend(src_.raw(), bytes_, ncclUint8, 0, comm_->get(), stream()));
        TPX_NCCL_CHECK(ncclRecv(dst_.raw(), bytes_, ncclUint8, 0, comm_->get(), stream()));
        TPX_NCCL_CHECK(ncclGroupEnd());
        return;
#endif
      case Mover::none:
      case Mover::copy_thread:
        break;
    }
    fail(fmt::format("no cuda mover '{}' in this build", mover_name(kind_)));
  }

 private:
  Mover kind_;
  std::size_t bytes_;
  Stream lane_;
  Tensor src_, dst_;
  int blocks_;
#if TPX_WITH_NCCL
  std::unique_ptr<SelfComm> comm_;
#endif
};

/// One contended iteration's result.
struct Contended {
  double gemm_s = 0.0;  // the GEMM's time, from its events
  double moved = 0.0;   // bytes moved inside the GEMM's window
  bool covered = true;  // the transfers ran from before the GEMM began until after it ended
};

void run_cuda(benchmark::State& state, DType compute, Mover kind, CudaOperands& operands) {
  cuda::ensure_initialized();
  const I n = state.range(0);
  const auto& [a, b] = operands.get(n, compute);
  const Tensor c = Tensor::empty({n, n}, DType::f32, Device::cuda);
  const std::size_t bytes = a.nbytes() + b.nbytes() + c.nbytes();
  const auto gemm = [&] { ops::gemm(a, false, b, false, c, 1.0f, 0.0f, compute); };
  const auto main_stream = static_cast<cudaStream_t>(cuda::current_stream());

  TimingEvents g;  // [0], [1]: around a GEMM on the default stream
  g.reserve(2);
  gemm();  // warm-up: the cuBLASLt plan, the stream's workspace
  const double alone = median_alone([&] {
    TPX_CUDA_CHECK(cudaEventRecord(g[0], main_stream));
    gemm();
    TPX_CUDA_CHECK(cudaEventRecord(g[1], main_stream));
    TPX_CUDA_CHECK(cudaEventSynchronize(g[1]));
    return ms_between(g[0], g[1]) / 1e3;
  });

  std::optional<CudaMover> mover;
  TimingEvents marks;  // [i]: before the mover's transfer i; [repeats]: after the last one
  double copy_alone_bps = 0.0;
  int repeats = 0;
  if (kind != Mover::none) {
    mover.emplace(kind, bytes);
    marks.reserve(2);
    mover->issue();  // warm-up (NCCL sets up its connection to itself on the first transfer)
    const double transfer = median_alone([&] {
      TPX_CUDA_CHECK(cudaEventRecord(marks[0], mover->stream()));
      mover->issue();
      TPX_CUDA_CHECK(cudaEventRecord(marks[1], mover->stream()));
      TPX_CUDA_CHECK(cudaEventSynchronize(marks[1]));
      return ms_between(marks[0], marks[1]) / 1e3;
    });
    copy_alone_bps = static_cast<double>(bytes) / transfer;
    repeats =
        std::clamp(static_cast<int>(std::ceil(kOutlast * alone / transfer)) + 2, 2, kMaxRepeats);
  }

  // The transfers go first (on the mover's stream, an event before each and after the last), the
  // GEMM after them on the default stream. Times are taken from marks[0], the earliest event.
  const auto contended = [&] {
    Contended r;
    if (mover) {
      marks.reserve(static_cast<std::size_t>(repeats) + 1);
      TPX_CUDA_CHECK(cudaEventRecord(marks[0], mover->stream()));
      for (int i = 1; i <= repeats; ++i) {
        mover->issue();
        TPX_CUDA_CHECK(cudaEventRecord(marks[static_cast<std::size_t>(i)], mover->stream()));
      }
    }
    TPX_CUDA_CHECK(cudaEventRecord(g[0], main_stream));
    gemm();
    TPX_CUDA_CHECK(cudaEventRecord(g[1], main_stream));
    TPX_CUDA_CHECK(cudaEventSynchronize(g[1]));
    r.gemm_s = ms_between(g[0], g[1]) / 1e3;
    if (!mover) return r;
    TPX_CUDA_CHECK(cudaStreamSynchronize(mover->stream()));
    const double begin = ms_between(marks[0], g[0]), end = ms_between(marks[0], g[1]);
    const auto at = [&](int i) { return ms_between(marks[0], marks[static_cast<std::size_t>(i)]); };
    r.covered = begin >= 0.0 && at(repeats) >= end;
    for (int i = 0; i < repeats; ++i) {
      const double s = at(i), e = at(i + 1);
      const double inside = std::min(e, end) - std::max(s, begin);
      if (inside > 0.0 && e > s) r.moved += static_cast<double>(bytes) * inside / (e - s);
    }
    return r;
  };

  // Calibration: more transfers until they outlast the contended GEMM.
  if (mover)
    while (!contended().covered && repeats < kMaxRepeats)
      repeats = std::min(2 * repeats, kMaxRepeats);

  Totals totals;
  for (auto _ : state) {
    const Contended r = contended();
    if (!r.covered) repeats = std::min(2 * repeats, kMaxRepeats);
    state.SetIterationTime(r.gemm_s);
    totals.gemm_s += r.gemm_s;
    totals.moved += r.moved;
  }
  report(state, n, alone, totals, copy_alone_bps, bytes);
}

void bm_cuda(benchmark::State& state, DType compute, Mover kind, CudaOperands& operands) {
  try {
    run_cuda(state, compute, kind, operands);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

#endif  // TPX_WITH_CUDA

void register_all() {
  for (Device d : devices()) {
    benchmark::AddCustomContext(fmt::format("tpx_device_{}", to_string(d)), device_label(d));
    if (d == Device::cpu) {
      for (Mover m : {Mover::none, Mover::copy_thread})
        benchmark::RegisterBenchmark(fmt::format("copy_overlap/cpu/fp32/{}", mover_name(m)).c_str(),
                                     [m](benchmark::State& s) { bm_cpu(s, m); })
            ->Arg(256)
            ->Arg(512)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      continue;
    }
#if TPX_WITH_CUDA
    // Shared by the cuda benchmarks, alive as long as the registered benchmarks hold it.
    const auto operands = std::make_shared<CudaOperands>();
    std::vector<Mover> movers{Mover::none, Mover::copy_engine, Mover::sm_copy};
#if TPX_WITH_NCCL
    movers.push_back(Mover::nccl);
#endif
    for (DType t : {DType::bf16, DType::f32})
      for (Mover m : movers)
        benchmark::RegisterBenchmark(
            fmt::format("copy_overlap/cuda/{}/{}", to_string(t), mover_name(m)).c_str(),
            [t, m, operands](benchmark::State& s) { bm_cuda(s, t, m, *operands); })
            ->Arg(4096)
            ->Arg(8192)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
#endif
  }
}

}  // namespace
}  // namespace tpx::bench

int main(int argc, char** argv) {
  return tpx::bench::run_benchmarks(argc, argv, tpx::bench::register_all);
}
