#include "trace.h"

#include <mpi.h>

#include <algorithm>
#include <iterator>
#include <utility>

#include <nlohmann/json.hpp>

#include "check.h"
#include "output.h"
#if TPX_WITH_CUDA
#include "cuda/nvtx.h"
#endif

namespace tpx {

void profiler_range_push([[maybe_unused]] const std::string& name) {
#if TPX_WITH_CUDA
  cuda::nvtx_push(name.c_str());
#endif
}

void profiler_range_pop() {
#if TPX_WITH_CUDA
  cuda::nvtx_pop();
#endif
}

namespace {

/// Lanes whose spans move data: communication for the exposed-comm figure.
bool moves(Lane lane) {
  return lane == Lane::comm || lane == Lane::copy || lane == Lane::dp_comm ||
         lane == Lane::cp_comm || lane == Lane::pp_comm || lane == Lane::ep_comm;
}

}  // namespace

Trace& Trace::off() {
  static Trace none(Mode::off);  // records nothing, so sharing it is safe
  return none;
}

void Trace::record(std::string name, Lane lane, Clock::time_point begin, Clock::time_point end,
                   bool counted) {
  if (!recording()) return;
  if (mode_ == Mode::measure) {
    // A step of a pipeline with many micro-batches records hundreds of thousands of spans: a
    // measuring trace keeps 24 bytes of each that counts, and drops the name.
    const bool compute = lane == Lane::compute;
    if (!compute && !(moves(lane) && counted)) return;
    std::lock_guard lock(mutex_);
    spans_.push_back({begin, end, compute});
    return;
  }
  std::lock_guard lock(mutex_);
  events_.push_back({std::move(name), lane, begin, end, counted});
}

namespace {

using Interval = std::pair<Trace::Clock::time_point, Trace::Clock::time_point>;

/// Sorted, disjoint intervals covering the same time as `v`.
std::vector<Interval> merged(std::vector<Interval> v) {
  std::sort(v.begin(), v.end());
  std::vector<Interval> out;
  for (const Interval& i : v) {
    if (!out.empty() && i.first <= out.back().second)
      out.back().second = std::max(out.back().second, i.second);
    else
      out.push_back(i);
  }
  return out;
}

}  // namespace

double Trace::exposed_comm_ms(Clock::time_point t0, Clock::time_point t1) {
  std::vector<Interval> comm, compute;
  {
    std::lock_guard lock(mutex_);
    const auto computes =
        std::count_if(spans_.begin(), spans_.end(), [](const Span& s) { return s.compute; });
    compute.reserve(std::size_t(computes));
    comm.reserve(spans_.size() - std::size_t(computes));
    for (const Event& e : events_) {
      const Clock::time_point b = std::max(e.begin, t0), en = std::min(e.end, t1);
      if (b >= en) continue;
      if (e.lane == Lane::compute) compute.emplace_back(b, en);
      if (moves(e.lane) && e.counted) comm.emplace_back(b, en);
    }
    for (const Span& s : spans_) {
      const Clock::time_point b = std::max(s.begin, t0), en = std::min(s.end, t1);
      if (b < en) (s.compute ? compute : comm).emplace_back(b, en);
    }
    std::erase_if(spans_, [&](const Span& s) { return s.end <= t1; });
  }
  // Walk the comm intervals and subtract the compute intervals that overlap each one.
  const std::vector<Interval> busy = merged(std::move(compute));
  Clock::duration exposed{};
  auto k = busy.begin();
  for (const auto& [b, e] : merged(std::move(comm))) {
    while (k != busy.end() && k->second <= b) ++k;
    Clock::time_point at = b;
    for (auto j = k; j != busy.end() && j->first < e; ++j) {
      if (j->first > at) exposed += j->first - at;
      at = std::max(at, j->second);
    }
    if (at < e) exposed += e - at;
  }
  return std::chrono::duration<double, std::milli>(exposed).count();
}

std::vector<std::string> Trace::span_names(Lane lane) const {
  std::lock_guard lock(mutex_);
  std::vector<std::string> names;
  for (const Event& e : events_)
    if (e.lane == lane) names.push_back(e.name);
  return names;
}

void Trace::write(const std::filesystem::path& path, int rank, int world,
                  const std::string& stage) const {
  static constexpr const char* kLaneNames[] = {"compute", "comm",    "copy",    "phases",
                                               "dp comm", "cp comm", "pp comm", "ep comm"};
  nlohmann::json mine = nlohmann::json::array();
  for (int lane = 0; lane < int(std::size(kLaneNames)); ++lane)
    mine.push_back({{"name", "thread_name"},
                    {"ph", "M"},
                    {"pid", rank},
                    {"tid", lane},
                    {"args", {{"name", kLaneNames[lane]}}}});
  mine.push_back({{"name", "process_name"},
                  {"ph", "M"},
                  {"pid", rank},
                  {"args", {{"name", fmt::format("rank {}", rank)}}}});
  using us = std::chrono::duration<double, std::micro>;
  {
    std::lock_guard lock(mutex_);
    for (const Event& e : events_) {
      nlohmann::json ev{{"name", e.name},
                        {"ph", "X"},
                        {"pid", rank},
                        {"tid", static_cast<int>(e.lane)},
                        {"ts", us(e.begin - origin_).count()},
                        {"dur", us(e.end - e.begin).count()}};
      if (!e.counted) ev["args"] = {{"counted", false}};
      mine.push_back(std::move(ev));
    }
  }

  // Gather every rank's serialised events on rank 0.
  const std::string text = mine.dump();
  int len = static_cast<int>(text.size());
  std::vector<int> lens(static_cast<std::size_t>(world)), offs(static_cast<std::size_t>(world));
  TPX_MPI_CHECK(MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, MPI_COMM_WORLD));
  std::string all;
  if (rank == 0) {
    int total = 0;
    for (int r = 0; r < world; ++r) {
      offs[static_cast<std::size_t>(r)] = total;
      total += lens[static_cast<std::size_t>(r)];
    }
    all.resize(static_cast<std::size_t>(total));
  }
  TPX_MPI_CHECK(MPI_Gatherv(text.data(), len, MPI_CHAR, all.data(), lens.data(), offs.data(),
                            MPI_CHAR, 0, MPI_COMM_WORLD));
  if (rank != 0) return;
  nlohmann::json events = nlohmann::json::array();
  for (int r = 0; r < world; ++r) {
    const auto part = nlohmann::json::parse(
        all.substr(static_cast<std::size_t>(offs[static_cast<std::size_t>(r)]),
                   static_cast<std::size_t>(lens[static_cast<std::size_t>(r)])));
    for (const auto& e : part) events.push_back(e);
  }
  nlohmann::json file{{"traceEvents", events}, {"displayTimeUnit", "ms"}};
  if (!stage.empty()) file["otherData"] = {{"stage", stage}, {"world_size", world}};
  write_text_file(path, file.dump(1) + '\n');
}

}  // namespace tpx
