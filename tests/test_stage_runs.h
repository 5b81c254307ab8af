// Helpers for tests that run stage executables and compare what they write: the --json summary
// of a run, and two --dump directories tensor by tensor; and the language model's ends' bytes
// over the DP×CP group by hand.
//
// defines: tpx::test::Sizes, tpx::test::run_json(), tpx::test::expect_refused_once(),
//          tpx::test::lm_ends_dp_bytes(), tpx::test::expect_dumps_close(),
//          tpx::test::stage01_reference()
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <gtest/gtest.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "common/npy.h"
#include "test_util.h"

namespace tpx::test {

/// The small model the mesh stages' tests run: H = 96 with NH = 12 heads of Dh = 8, F = 192,
/// S = 24 (2C·T divides it at C = 2, T = 2 and at C = 3), B = 2, two layers.
struct Sizes {
  std::int64_t H = 96, NH = 12, F = 192, S = 24, B = 2, L = 2;
  std::string args() const {
    return fmt::format("--hidden {} --heads {} --ffn {} --seq {} --batch {} --layers {}", H, NH, F,
                       S, B, L);
  }
};

#ifdef TPX_MPIEXEC_FLAGS
/// The --json summary of `mpirun -np n <stage> <args>` (an empty object, and a failure, when the
/// run fails).
inline nlohmann::json run_json(const std::string& stage, int n, const std::string& args) {
  TempDir dir;
  const auto r = run_stage(stage, n, args + " --json " + (dir / "s.json").string(), dir);
  EXPECT_EQ(r.exit_code, 0) << stage << " " << args << "\n" << r.out << r.err;
  if (r.exit_code != 0) return nlohmann::json::object();
  return nlohmann::json::parse(read_file(dir / "s.json"));
}

/// Stage 01's run with `args` (which name neither --dump nor --json), as a directory holding its
/// `dump/` and its `run.json`: the reference that the mesh stages' tests compare their dumps and
/// losses with. Made once per build of 01_baseline and kept under the build tree (one directory
/// per build, named by the binary's modification time, holding a run per flag set; a new build's
/// first run removes the older builds'), so that the many cases comparing with one flag set run
/// stage 01 once; made under a temporary name and renamed into place, so that tests running
/// at the same time never read a half-written one. A failed run is a test failure and an empty
/// path.
inline std::filesystem::path stage01_reference(const std::string& args) {
  namespace fs = std::filesystem;
  const auto stamp = fs::last_write_time(stage_binary("01_baseline")).time_since_epoch().count();
  const std::string key = fmt::format("{:016x}", std::hash<std::string>{}(block_task(args)));
  const fs::path root = fs::path(TPX_BIN_DIR).parent_path() / "test-cache" / "stage01";
  const fs::path cache = root / fmt::format("{:016x}", static_cast<std::uint64_t>(stamp));
  const fs::path dir = cache / key;
  if (fs::exists(dir)) return dir;
  if (!fs::exists(cache)) {  // a new build of 01_baseline: the older builds' runs go
    std::error_code ignored;
    std::vector<fs::path> older;
    for (const auto& entry : fs::directory_iterator(root, ignored))
      if (entry.path().filename() != cache.filename()) older.push_back(entry.path());
    for (const auto& path : older) fs::remove_all(path, ignored);
  }
  fs::create_directories(cache);
  const fs::path staged = cache / (key + ".tmp" + std::to_string(::getpid()));
  fs::remove_all(staged);
  fs::create_directories(staged);
  TempDir scratch;
  const auto r = run_stage("01_baseline", 1,
                           fmt::format("{} --dump {} --json {}", args, (staged / "dump").string(),
                                       (staged / "run.json").string()),
                           scratch);
  EXPECT_EQ(r.exit_code, 0) << "01_baseline " << args << "\n" << r.out << r.err;
  if (r.exit_code != 0) {
    fs::remove_all(staged);
    return {};
  }
  std::error_code ec;
  fs::rename(staged, dir, ec);  // fails only when another test put the same run there first
  if (ec) fs::remove_all(staged);
  return dir;
}

/// `mpirun -np n <stage> <args>` refuses: exit 2, and one line "<stage>: error: …" containing
/// `words` (every rank refuses alike, so the agreed line is printed once, not once per rank).
/// Returns the run, for a caller's further checks.
inline CommandResult expect_refused_once(const std::string& stage, int n, const std::string& args,
                                         const std::string& words) {
  TempDir dir;
  auto r = run_stage(stage, n, args, dir);
  EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.out << r.err;
  int lines = 0;
  for (const auto& line : lines_of(r.err))
    if (line.starts_with(stage + ": error:")) {
      ++lines;
      EXPECT_NE(line.find(words), std::string::npos) << line;
    }
  EXPECT_EQ(lines, 1) << "the ranks' agreed error, printed once:\n" << r.err;
  return r;
}
#endif

/// One rank's DP×CP bytes of a step from the language model's ends (chapters 7-9), as (payload,
/// bus): each end is an FSDP unit of its own, gathered before each use (the embedding before the
/// lookup, the head's gain and output layer before the head; once per micro-batch, `m` of them)
/// at the bytes it computes with (fp32 but W_out, bf16 under the recipe) and reduce-scattered
/// once in fp32; each TP-local tensor's rows split into G shards of ⌈rows/G⌉ (V_p = ⌈V/T⌉ rows
/// of E, H of the gain and of W_out [H, V_p]); nccl-tests' bus bytes, (G−1)/G of each buffer.
/// `embedding`, `head`: the ends the rank holds.
inline std::pair<std::uint64_t, std::uint64_t> lm_ends_dp_bytes(std::int64_t h, std::int64_t v,
                                                                int t, int g, int m, bool bf16,
                                                                bool embedding = true,
                                                                bool head = true) {
  const std::int64_t vp = (v + t - 1) / t;
  auto rows = [&](std::int64_t r) { return (r + g - 1) / g; };
  const std::int64_t table = embedding ? rows(vp) * h : 0;
  const std::int64_t gain = head ? rows(h) : 0, w_out = head ? rows(h) * vp : 0;
  const std::int64_t gathered = 4 * table + 4 * gain + (bf16 ? 2 : 4) * w_out;  // one rank's part
  const std::int64_t reduced = 4 * (table + gain + w_out);
  return {std::uint64_t(g * (m * gathered + reduced)),
          std::uint64_t((g - 1) * (m * gathered + reduced))};
}

/// Every tensor of `want_dir`'s dump within rtol · max|want| of `got_dir`'s; the int32 token ids
/// and targets (--task lm) byte for byte.
inline void expect_dumps_close(const std::filesystem::path& want_dir,
                               const std::filesystem::path& got_dir, double rtol,
                               const std::string& what) {
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(want_dir)) {
    if (entry.path().extension() != ".npy") continue;
    ++files;
    const std::string name = entry.path().filename().string();
    if (const std::string bytes = read_file(entry.path());
        bytes.substr(0, 128).find("'<i4'") != std::string::npos) {
      EXPECT_EQ(read_file(got_dir / name), bytes) << name << ": " << what;
      continue;
    }
    const NpyArray want = read_npy(entry.path());
    const NpyArray got = read_npy(got_dir / name);
    ASSERT_EQ(got.shape, want.shape) << name << " " << what;
    double scale = 0.0, err = 0.0;
    for (std::size_t i = 0; i < want.data.size(); ++i) {
      scale = std::max(scale, std::abs(double(want.data[i])));
      err = std::max(err, std::abs(double(got.data[i]) - double(want.data[i])));
    }
    EXPECT_LE(err, rtol * scale) << name << ": " << what;
  }
  EXPECT_GT(files, 20) << "the dump of " << want_dir << " is missing tensors";
}

}  // namespace tpx::test
