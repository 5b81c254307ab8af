// Collective bandwidth over a size sweep, in nccl-tests' convention (bench/busbw.h): the
// communicator's all_reduce, all_gather, reduce_scatter, broadcast and sendrecv (each rank sends
// to r+1 and receives from r−1: one step of the rings of stage 04), and stage 05's symmetric-memory
// pull (every rank pulls every rank's part of an all-gather out of symmetric memory by copy; the
// parts are published once, so the time is the copies' alone), on the cpu (MPI over host memory)
// and on cuda when a GPU is usable (NCCL, or MPI staged through the host when ranks share a GPU).
// fp32, sum.
//
// Under mpirun every rank registers the same benchmarks with the same fixed iteration count (a
// function of the size alone), waits at a barrier before each timed operation, and reports the
// slowest rank's time (MPI_Allreduce MAX) as the manual time of the iteration. Only rank 0
// reports: the other ranks print nothing and write no file (their --benchmark_out is dropped).
//
// Counters per benchmark (name collective/<op>/<cpu|cuda>/<bytes>, to which Google Benchmark
// appends /iterations:<n>/manual_time):
//   bytes       nccl-tests' size of the op (all_gather, reduce_scatter, symm_pull: the gathered
//               buffer; the others: one rank's buffer), after rounding the element count down to a
//               multiple of the ranks
//   count       elements (fp32) in that size
//   time_us     the mean over the iterations of the slowest rank's time
//   algbw_GBps  bytes / time;  busbw_GBps  algbw · bus_factor (busbw.h)
//   wrong       elements that differ from the known result of one more run after the timed loop
//               (inputs are small integers, so every sum is exact); like nccl-tests' #wrong
//   ranks       N
// After the run rank 0 prints one nccl-tests-shaped table per op, and the program exits 1 if any
// result was wrong.
//
//   mpirun -np N build/bin/bench_collectives [--min-bytes 1K] [--max-bytes 256M]
//       [--benchmark_filter=all_reduce/cpu] [--benchmark_out=F --benchmark_out_format=json]
// Sizes go from --min-bytes to --max-bytes by ×4 (suffixes K, M, G: powers of 1024).
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "05_copy_engine_async_tp/symmetric_memory.h"
#include "bench_util.h"
#include "busbw.h"
#include "common/check.h"
#include "common/comm/communicator.h"
#include "common/trace.h"

namespace tpx::bench {
namespace {

using I = std::int64_t;
using Clock = std::chrono::steady_clock;

constexpr Collective kOps[] = {Collective::all_reduce,     Collective::all_gather,
                               Collective::reduce_scatter, Collective::broadcast,
                               Collective::sendrecv,       Collective::symm_pull};

/// "64K" → 65536; plain digits are bytes. Throws tpx::Error on anything else.
std::uint64_t parse_bytes(const std::string& s) {
  std::size_t used = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(s, &used);
  } catch (const std::exception&) {
    fail(fmt::format("not a byte size: '{}' (expected e.g. 1K, 4M, 256M)", s));
  }
  const std::string suffix = s.substr(used);
  const std::map<std::string, int> shift{{"", 0},   {"K", 10}, {"k", 10}, {"M", 20},
                                         {"m", 20}, {"G", 30}, {"g", 30}};
  const auto it = shift.find(suffix);
  if (it == shift.end() || v == 0)
    fail(fmt::format("not a byte size: '{}' (expected e.g. 1K, 4M, 256M)", s));
  return static_cast<std::uint64_t>(v) << it->second;
}

/// Iterations for a size: the same on every rank (a function of the size alone), enough to move
/// about 64 MiB, between 5 and 200.
I iterations_for(std::uint64_t bytes) {
  return std::clamp<I>(static_cast<I>((std::uint64_t{64} << 20) / bytes), 5, 200);
}

/// What one benchmark needs: ranks, the communicator of its device.
struct World {
  int rank = 0, size = 1;
  Communicator* comm = nullptr;
};

/// The elements of one rank's part and of the op's counted buffer (nccl-tests' size).
struct Counts {
  I part = 0;   // elements each rank contributes (all_gather, reduce_scatter, symm_pull: 1/N)
  I total = 0;  // elements in nccl-tests' size
};

Counts counts_for(Collective op, std::uint64_t bytes, int n) {
  I count = static_cast<I>(bytes / sizeof(float));
  count -= count % n;  // as nccl-tests does: a whole number of elements per rank
  switch (op) {
    case Collective::all_gather:
    case Collective::reduce_scatter:
    case Collective::symm_pull:
      return {count / n, count};
    default:
      return {count, count};
  }
}

/// Host tensor with element i = f(i).
template <class F>
Tensor host_filled(I count, F f) {
  Tensor t = Tensor::empty({count});
  auto v = t.f32();
  for (I i = 0; i < count; ++i) v[static_cast<std::size_t>(i)] = f(i);
  return t;
}

/// Elements of `got` (any device) that differ from want(i).
template <class F>
I count_wrong(const Tensor& got, F want) {
  const Tensor h = got.device() == Device::cpu ? got : ops::to_device(got, Device::cpu);
  I wrong = 0;
  auto v = h.f32();
  for (I i = 0; i < static_cast<I>(v.size()); ++i)
    if (v[static_cast<std::size_t>(i)] != want(i)) ++wrong;
  return wrong;
}

// Known inputs (small integers: every sum below is exact in fp32) and their results.
float gather_value(int rank, I i) {
  return static_cast<float>(1000 * rank + i % 1000);
}
float sum_input(int rank, I i) {
  return static_cast<float>(rank + 1 + i % 7);
}
float sum_result(int n, I i) {
  return static_cast<float>(n * (n + 1) / 2 + n * (i % 7));
}

/// One op on one device: the buffers, the operation, and the check of its result.
class Op {
 public:
  virtual ~Op() = default;
  virtual void run() = 0;    // one operation, issued and completed
  virtual void reset() = 0;  // the known inputs again (after the timed loop)
  virtual I wrong() = 0;     // after one run() following reset()
  virtual void finish() {}   // collective clean-up before the buffers go
};

class CommOp final : public Op {
 public:
  CommOp(Collective op, const World& w, Device d, Counts c)
      : op_(op), w_(w), d_(d), c_(c), stream_(d) {
    const I in = op == Collective::reduce_scatter ? c.total : c.part;
    const I out = op == Collective::all_gather       ? c.total
                  : op == Collective::reduce_scatter ? c.part
                                                     : in;
    in_ = Tensor::empty({in}, DType::f32, d);
    out_ = Tensor::empty({out}, DType::f32, d);
    reset();
  }
  void run() override {
    const int n = w_.size, r = w_.rank;
    switch (op_) {
      case Collective::all_reduce:
        w_.comm->all_reduce(in_, stream_);
        break;
      case Collective::all_gather:
        w_.comm->all_gather(in_, out_, stream_);
        break;
      case Collective::reduce_scatter:
        w_.comm->reduce_scatter(in_, out_, stream_);
        break;
      case Collective::broadcast:
        w_.comm->broadcast(in_, 0, stream_);
        break;
      case Collective::sendrecv:
        w_.comm->sendrecv(in_, (r + 1) % n, out_, (r + n - 1) % n, stream_, "bench ring step");
        break;
      case Collective::symm_pull:
        break;
    }
    stream_.synchronize();
    ops::synchronize(d_);
  }
  void reset() override {
    const int r = w_.rank;
    const I count = in_.numel();
    Tensor h;
    switch (op_) {
      case Collective::all_reduce:
      case Collective::reduce_scatter:
        h = host_filled(count, [r](I i) { return sum_input(r, i); });
        break;
      case Collective::broadcast:
        h = host_filled(count, [r](I i) { return r == 0 ? gather_value(0, i) : -1.0f; });
        break;
      default:
        h = host_filled(count, [r](I i) { return gather_value(r, i); });
        break;
    }
    in_ = d_ == Device::cpu ? h : ops::to_device(h, d_);
  }
  I wrong() override {
    const int n = w_.size, r = w_.rank;
    const I part = c_.part;
    switch (op_) {
      case Collective::all_reduce:
        return count_wrong(in_, [n](I i) { return sum_result(n, i); });
      case Collective::all_gather:
        return count_wrong(out_, [part](I i) { return gather_value(int(i / part), i % part); });
      case Collective::reduce_scatter:
        return count_wrong(out_, [n, r, part](I i) { return sum_result(n, r * part + i); });
      case Collective::broadcast:
        return count_wrong(in_, [](I i) { return gather_value(0, i); });
      case Collective::sendrecv:
        return count_wrong(out_, [n, r](I i) { return gather_value((r + n - 1) % n, i); });
      case Collective::symm_pull:
        break;
    }
    return 0;
  }

 private:
  Collective op_;
  World w_;
  Device d_;
  Counts c_;
  Stream stream_;
  Tensor in_, out_;
};

/// Stage 05's all-gather by copies: each rank's part sits in its symmetric memory; every rank
/// pulls all N parts (its own is a local copy, not counted as traffic) on its copy lane.
class PullOp final : public Op {
 public:
  PullOp(const World& w, Device d, Counts c) : w_(w), d_(d), c_(c) {
    SymmetricOptions o;
    mem_ =
        make_symmetric_memory(d, static_cast<std::size_t>(c.part) * sizeof(float), o, Trace::off());
    out_ = Tensor::empty({c.total}, DType::f32, d);
    const int r = w.rank;
    const Tensor mine = mem_->local({c.part}, DType::f32, 0);
    ops::copy(d == Device::cpu
                  ? host_filled(c.part, [r](I i) { return gather_value(r, i); })
                  : ops::to_device(host_filled(c.part, [r](I i) { return gather_value(r, i); }), d),
              mine);
    ops::synchronize(d);
    mem_->barrier();  // every part is published before anyone pulls
  }
  void run() override {
    for (int j = 0; j < w_.size; ++j) {
      const int p = (w_.rank + j) % w_.size;  // from r, r+1, …: one reader per buffer at a time
      mem_->pull(p, 0, out_.slice0(p * c_.part, (p + 1) * c_.part), mem_->copy_stream(),
                 "bench pull");
    }
    mem_->copy_stream().synchronize();
  }
  void reset() override { ops::fill(out_, -1.0f); }
  I wrong() override {
    const I part = c_.part;
    return count_wrong(out_, [part](I i) { return gather_value(int(i / part), i % part); });
  }
  void finish() override { mem_->barrier(); }  // nobody frees while a peer may still pull

 private:
  World w_;
  Device d_;
  Counts c_;
  std::unique_ptr<SymmetricMemory> mem_;
  Tensor out_;
};

double max_over_ranks(double v) {
  double m = v;
  MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

I sum_over_ranks(I v) {
  long long s = 0, mine = v;
  MPI_Allreduce(&mine, &s, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  return static_cast<I>(s);
}

void bm_collective(benchmark::State& state, Collective op, World w, Device d,
                   std::uint64_t nominal) {
  const Counts c = counts_for(op, nominal, w.size);
  std::unique_ptr<Op> o;
  if (op == Collective::symm_pull)
    o = std::make_unique<PullOp>(w, d, c);
  else
    o = std::make_unique<CommOp>(op, w, d, c);
  o->run();            // warm-up, untimed
  double total = 0.0;  // the slowest rank's seconds, summed over the iterations
  for (auto _ : state) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = Clock::now();
    o->run();
    const double slowest = max_over_ranks(std::chrono::duration<double>(Clock::now() - t0).count());
    state.SetIterationTime(slowest);
    total += slowest;
  }
  o->reset();
  MPI_Barrier(MPI_COMM_WORLD);
  o->run();
  const I wrong = sum_over_ranks(o->wrong());
  o->finish();
  const double bytes = static_cast<double>(c.total) * sizeof(float);
  const double seconds = total / static_cast<double>(std::max<I>(state.iterations(), 1));
  state.counters["bytes"] = bytes;
  state.counters["count"] = static_cast<double>(c.total);
  state.counters["ranks"] = w.size;
  state.counters["wrong"] = static_cast<double>(wrong);
  state.counters["time_us"] = seconds * 1e6;  // the mean of the slowest rank's times
  state.counters["algbw_GBps"] = algbw_GBps(bytes, seconds);
  state.counters["busbw_GBps"] = busbw_GBps(op, w.size, bytes, seconds);
  state.SetLabel(fmt::format("N={}", w.size));
}

/// Prints nothing: the reporter of ranks other than 0.
class NullReporter final : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

/// Rank 0's console: Google Benchmark's, and the runs kept for the nccl-tests tables.
class TableReporter final : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) kept.push_back(r);
  }
  std::vector<Run> kept;
};

double counter(const benchmark::BenchmarkReporter::Run& r, const char* name) {
  const auto it = r.counters.find(name);
  return it == r.counters.end() ? 0.0 : it->second.value;
}

/// One table per op and device, shaped like nccl-tests' output. Returns the wrong elements seen.
I print_tables(const std::vector<benchmark::BenchmarkReporter::Run>& runs, int ranks) {
  I wrong = 0;
  std::string current;
  for (const auto& r : runs) {
    // collective/<op>/<device>/<bytes>, then Google Benchmark's /iterations:N/manual_time
    const std::string name = r.benchmark_name();
    const std::size_t op_at = name.find('/') + 1, dev_at = name.find('/', op_at) + 1;
    const std::string op = name.substr(op_at, dev_at - 1 - op_at);
    const std::string table = name.substr(0, name.find('/', dev_at));
    if (table != current) {
      current = table;
      std::printf("\n# %s, %d ranks, fp32 (nccl-tests convention: bench/busbw.h)\n", table.c_str(),
                  ranks);
      std::printf("# %12s %12s %6s %6s %6s %10s %12s %12s %7s\n", "size", "count", "type", "redop",
                  "root", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong");
    }
    const bool sum = op == "all_reduce" || op == "reduce_scatter";
    const char* root = op == "broadcast" ? "0" : "-1";
    const double w = counter(r, "wrong");
    wrong += static_cast<I>(w);
    std::printf("  %12.0f %12.0f %6s %6s %6s %10.2f %12.3f %12.3f %7.0f\n", counter(r, "bytes"),
                counter(r, "count"), "float", sum ? "sum" : "none", root, counter(r, "time_us"),
                counter(r, "algbw_GBps"), counter(r, "busbw_GBps"), w);
  }
  return wrong;
}

/// Removes `--name VALUE` / `--name=VALUE` from argv; returns the value or `fallback`.
std::string take_flag(int& argc, char** argv, std::string_view name, std::string fallback) {
  std::string value = std::move(fallback);
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == name) {
      if (i + 1 >= argc) fail(fmt::format("{} needs a value", name));
      value = argv[++i];
    } else if (a.size() > name.size() && a.substr(0, name.size()) == name &&
               a[name.size()] == '=') {
      value = std::string(a.substr(name.size() + 1));
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  argv[argc] = nullptr;
  return value;
}

/// Drops Google Benchmark's file output flags (ranks other than 0 write no file).
void drop_file_output(int& argc, char** argv) {
  int out = 1;
  for (int i = 1; i < argc; ++i)
    if (std::string_view(argv[i]).rfind("--benchmark_out", 0) != 0) argv[out++] = argv[i];
  argc = out;
  argv[argc] = nullptr;
}

int run(int argc, char** argv, int rank, int size) {
  const std::uint64_t lo = parse_bytes(take_flag(argc, argv, "--min-bytes", "1K"));
  const std::uint64_t hi = parse_bytes(take_flag(argc, argv, "--max-bytes", "256M"));
  if (lo > hi) fail("--min-bytes is larger than --max-bytes");
  if (rank != 0) drop_file_output(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;

  std::vector<std::unique_ptr<Communicator>> comms;
  for (Device d : devices()) {
    comms.push_back(make_communicator(CommOptions{}, d));
    const World w{rank, size, comms.back().get()};
    if (rank == 0)
      benchmark::AddCustomContext(fmt::format("tpx_comm_{}", to_string(d)), w.comm->name());
    for (Collective op : kOps)
      for (std::uint64_t b = lo; b <= hi; b *= 4)
        benchmark::RegisterBenchmark(
            fmt::format("collective/{}/{}/{}", collective_name(op), to_string(d), b).c_str(),
            [op, w, d, b](benchmark::State& s) { bm_collective(s, op, w, d, b); })
            ->Iterations(iterations_for(b))
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond);
  }
  benchmark::AddCustomContext("tpx_ranks", std::to_string(size));

  I wrong = 0;
  if (rank == 0) {
    TableReporter console;
    benchmark::RunSpecifiedBenchmarks(&console);
    wrong = print_tables(console.kept, size);
    if (wrong > 0)
      std::printf("\ncollectives: %lld wrong elements\n", static_cast<long long>(wrong));
    std::fflush(stdout);
  } else {
    NullReporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
  MPI_Bcast(&wrong, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
  return wrong > 0 ? 1 : 0;
}

}  // namespace
}  // namespace tpx::bench

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int code = 0;
  try {
    code = tpx::bench::run(argc, argv, rank, size);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_collectives: error: %s\n", e.what());
    code = 2;
  }
  MPI_Finalize();
  return code;
}
