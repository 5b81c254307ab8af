// A timeline of each rank's lanes, and the one measure of overlap every stage reports.
//
// Spans are recorded on lanes (compute, comm, copy, and the trainer's phases) with the host's
// steady clock, from whichever thread runs the work: on the cpu backend a created Stream's
// thread records the spans of the work it runs, so the timeline shows what really ran at the same
// time. `--trace FILE` writes them as a Chrome / Perfetto trace ("Trace Event Format", JSON: one
// process per rank, one thread per lane, complete events "ph": "X" in microseconds); open it in
// https://ui.perfetto.dev or chrome://tracing.
//
// Exposed communication (defined once here, used by every stage's step table and --json): the
// time within a step during which a comm (or copy) span runs and no compute span does, i.e. the
// measure of  ∪ comm spans  \  ∪ compute spans.  A stage that communicates on the caller's
// thread (02, 03) exposes all of its communication; a stage that overlaps (04+) exposes only what
// its compute lane cannot cover. Reporting-only traffic (the loss scalar, --check gathers) is
// recorded as not counted.
//
// On the cuda backend the spans are host-side: a GEMM's span is its launch, not its run on the
// GPU, so the trace shows the order of issue and the exposed figure is not a device measurement;
// Nsight Systems (the NVTX ranges below) shows the device timeline.
//
// defines: tpx::Lane, tpx::Trace, tpx::TraceScope, tpx::profiler_range_push/pop
#pragma once

#include <chrono>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

namespace tpx {

/// The lanes of a rank: where work ran. `phase` holds the trainer's forward / backward / update;
/// `dp_comm` the data-parallel group's transfers (stage 07), beside the TP group's `comm`;
/// `cp_comm` the context-parallel group's K/V transfers (stage 08); `pp_comm` the pipeline's
/// activations and gradients between stages (stage 09); `ep_comm` the experts' all-to-alls, their
/// dispatch and combine (stage 10).
enum class Lane : int {
  compute = 0,
  comm = 1,
  copy = 2,
  phase = 3,
  dp_comm = 4,
  cp_comm = 5,
  pp_comm = 6,
  ep_comm = 7
};

class Trace {
 public:
  using Clock = std::chrono::steady_clock;
  enum class Mode {
    off,      ///< records nothing (reference runs, tests)
    measure,  ///< keeps only what the exposed-comm figure reads of each step's spans (their
              ///< times and kind, no names: 24 bytes a span), then forgets them
    keep,     ///< records and keeps every span for write()
  };

  explicit Trace(Mode mode = Mode::off) : mode_(mode), origin_(Clock::now()) {}
  /// A trace that records nothing, for code run outside a stage (tests, references).
  static Trace& off();

  bool recording() const { return mode_ != Mode::off; }
  /// True when the spans are kept for write().
  bool enabled() const { return mode_ == Mode::keep; }

  /// Records [begin, end) on a lane; `counted` false for reporting-only traffic. Thread-safe.
  void record(std::string name, Lane lane, Clock::time_point begin, Clock::time_point end,
              bool counted = true);

  /// Exposed communication in [t0, t1), in milliseconds (definition above), from the spans
  /// recorded so far. Unless the trace is kept, spans ending before t1 are then forgotten.
  double exposed_comm_ms(Clock::time_point t0, Clock::time_point t1);

  /// The names of the spans kept so far on `lane`, in the order they were recorded (kept
  /// traces; a measuring one keeps no names).
  std::vector<std::string> span_names(Lane lane) const;

  /// Collective over MPI_COMM_WORLD: gathers every rank's events and rank 0 writes the file (whole
  /// or not at all, see output.h). `stage` names the run in the file's "otherData" (with the
  /// world size), where timeline drawings take their title from.
  void write(const std::filesystem::path& path, int rank, int world,
             const std::string& stage = {}) const;

 private:
  struct Event {
    std::string name;
    Lane lane;
    Clock::time_point begin, end;
    bool counted;
  };
  /// What a measuring trace keeps of a span: compute, or communication the figure counts
  /// (spans of the other lanes, and reporting-only traffic, are not kept at all).
  struct Span {
    Clock::time_point begin, end;
    bool compute;
  };
  Mode mode_;
  Clock::time_point origin_;
  mutable std::mutex mutex_;
  std::vector<Event> events_;  // keep
  std::vector<Span> spans_;    // measure
};

/// Opens / closes a profiler range (NVTX when the CUDA backend is built, else nothing), so an
/// Nsight Systems timeline shows the same phases as the Chrome trace.
void profiler_range_push(const std::string& name);
void profiler_range_pop();

/// Records the enclosing scope on a lane, and as a profiler range.
class TraceScope {
 public:
  TraceScope(Trace& trace, std::string name, Lane lane = Lane::compute, bool counted = true)
      : trace_(trace),
        name_(std::move(name)),
        lane_(lane),
        counted_(counted),
        begin_(Trace::Clock::now()) {
    profiler_range_push(name_);
  }
  ~TraceScope() {
    profiler_range_pop();
    if (trace_.recording())
      trace_.record(std::move(name_), lane_, begin_, Trace::Clock::now(), counted_);
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  Trace& trace_;
  std::string name_;
  Lane lane_;
  bool counted_;
  Trace::Clock::time_point begin_;
};

}  // namespace tpx
