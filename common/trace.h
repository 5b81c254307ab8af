// A Chrome / Perfetto trace ("Trace Event Format", JSON): one process per rank, one thread (lane)
// per stream, complete events ("ph": "X") with microsecond timestamps. Open the file in
// https://ui.perfetto.dev or chrome://tracing to see what overlapped.
//
// defines: tpx::Lane, tpx::Trace, tpx::TraceScope, tpx::profiler_range_push/pop
#pragma once

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

namespace tpx {

/// The lanes of a rank: where work was issued.
enum class Lane : int { compute = 0, comm = 1, copy = 2 };

class Trace {
 public:
  using Clock = std::chrono::steady_clock;

  /// A disabled trace records nothing and costs one branch per scope.
  explicit Trace(bool enabled = false) : enabled_(enabled), origin_(Clock::now()) {}
  bool enabled() const { return enabled_; }

  /// Records [begin, end) on a lane.
  void record(std::string name, Lane lane, Clock::time_point begin, Clock::time_point end);

  /// Collective over MPI_COMM_WORLD: gathers every rank's events and rank 0 writes the file (whole
  /// or not at all, see output.h).
  void write(const std::filesystem::path& path, int rank, int world) const;

 private:
  struct Event {
    std::string name;
    Lane lane;
    double ts_us, dur_us;
  };
  bool enabled_;
  Clock::time_point origin_;
  std::vector<Event> events_;
};

/// Opens / closes a profiler range (NVTX when the CUDA backend is built, else nothing), so an
/// Nsight Systems timeline shows the same phases as the Chrome trace.
void profiler_range_push(const std::string& name);
void profiler_range_pop();

/// Records the enclosing scope on a lane when the trace is enabled, and as a profiler range.
class TraceScope {
 public:
  TraceScope(Trace& trace, std::string name, Lane lane = Lane::compute)
      : trace_(trace), name_(std::move(name)), lane_(lane), begin_(Trace::Clock::now()) {
    profiler_range_push(name_);
  }
  ~TraceScope() {
    profiler_range_pop();
    if (trace_.enabled()) trace_.record(std::move(name_), lane_, begin_, Trace::Clock::now());
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  Trace& trace_;
  std::string name_;
  Lane lane_;
  Trace::Clock::time_point begin_;
};

}  // namespace tpx
