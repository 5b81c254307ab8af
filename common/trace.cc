#include "trace.h"

#include <mpi.h>

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

void Trace::record(std::string name, Lane lane, Clock::time_point begin, Clock::time_point end) {
  using us = std::chrono::duration<double, std::micro>;
  events_.push_back({std::move(name), lane, us(begin - origin_).count(), us(end - begin).count()});
}

void Trace::write(const std::filesystem::path& path, int rank, int world) const {
  static constexpr const char* kLaneNames[] = {"compute", "comm", "copy"};
  nlohmann::json mine = nlohmann::json::array();
  for (int lane = 0; lane < 3; ++lane)
    mine.push_back({{"name", "thread_name"},
                    {"ph", "M"},
                    {"pid", rank},
                    {"tid", lane},
                    {"args", {{"name", kLaneNames[lane]}}}});
  mine.push_back({{"name", "process_name"},
                  {"ph", "M"},
                  {"pid", rank},
                  {"args", {{"name", fmt::format("rank {}", rank)}}}});
  for (const Event& e : events_)
    mine.push_back({{"name", e.name},
                    {"ph", "X"},
                    {"pid", rank},
                    {"tid", static_cast<int>(e.lane)},
                    {"ts", e.ts_us},
                    {"dur", e.dur_us}});

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
  write_text_file(
      path, nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump(1) + '\n');
}

}  // namespace tpx
