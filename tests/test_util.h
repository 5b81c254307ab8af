// Small helpers shared by the test programs: random tensors, host copies, temporary directories,
// running a command and capturing its exit status, stdout and stderr.
//
// defines: tpx::test::random_tensor(), fill_random(), to_doubles(), max_abs(), adamw_step(), TempDir,
//          CommandResult, run_command(), lines_of(), stage_binary(), kRootMpiEnv
#pragma once

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/ops.h"
#include "common/tensor.h"

namespace tpx::test {

/// Fills a cpu f32 tensor with mean + std·N(0, 1) from a seeded Mersenne twister (independent of
/// the library's own initialiser, so tests do not lean on the code they check).
inline void fill_random(const Tensor& t, std::uint32_t seed, double mean = 0.0, double std = 1.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(mean, std);
  for (float& v : t.f32()) v = static_cast<float>(dist(gen));
}

inline Tensor random_tensor(Tensor::Shape shape, std::uint32_t seed, double mean = 0.0,
                            double std = 1.0) {
  Tensor t = Tensor::empty(std::move(shape));
  fill_random(t, seed, mean, std);
  return t;
}

/// The values of a cpu f32 tensor, widened to double.
/// AdamW's scalars of step t (from 1) as the trainer computes them: in double, rounded once.
inline ops::AdamWStep adamw_step(double lr, double b1, double b2, double eps, double wd, int t) {
  return {float(b1),
          float(b2),
          float(eps),
          float(1 - lr * wd),
          float(lr / (1 - std::pow(b1, t))),
          float(std::sqrt(1 - std::pow(b2, t)))};
}

inline std::vector<double> to_doubles(const Tensor& t) {
  auto s = t.f32();
  return {s.begin(), s.end()};
}

inline double max_abs(const std::vector<double>& v) {
  double m = 0.0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

/// A fresh directory under the system temp dir, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "tpx-test-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) fail("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

struct CommandResult {
  int exit_code = -1;  ///< the shell's exit status (124 when `timeout` killed the command)
  std::string out;
  std::string err;
};

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Runs `command` through /bin/sh; stdout through a pipe, stderr through a file in `scratch`.
inline CommandResult run_command(const std::string& command, const TempDir& scratch) {
  const auto err_path = scratch / "stderr.txt";
  const std::string full = "(" + command + ") 2>'" + err_path.string() + "'";
  CommandResult r;
  FILE* pipe = popen(full.c_str(), "r");
  if (pipe == nullptr) fail("popen failed for: " + command);
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) r.out.append(buf, n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.err = read_file(err_path);
  return r;
}

/// Non-empty lines of a text.
inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) lines.push_back(line);
  return lines;
}

/// Path of a stage executable in the build tree.
inline std::string stage_binary(const std::string& name) {
  return (std::filesystem::path(TPX_BIN_DIR) / name).string();
}

/// `args` with --task block put first unless they name a task (first: what follows may be shell): the blocks' machinery is what most
/// tests check (their traffic, memory, recompute, dumps of x and T); the language model's tests
/// say --task lm.
inline std::string block_task(const std::string& args) {
  return args.find("--task") == std::string::npos ? "--task block " + args : args;
}

/// Environment for mpirun run as root and oversubscribed on a small machine, set in the command
/// itself so that a test also runs outside ctest; one node's quick start and end (ob1 rather than
/// UCX, no second-long waits after an error exit) as cmake/TpxStage.cmake's TPX_TEST_ENV.
inline constexpr const char* kRootMpiEnv =
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1 "
    "OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_pml=ob1 OMPI_MCA_odls_base_sigkill_timeout=0";

#ifdef TPX_MPIEXEC_FLAGS
/// `mpirun -np N build/bin/<stage> <args>` in `dir`, with a wall-clock limit so that a hang fails
/// instead of blocking (for test targets compiled with TPX_MPIEXEC_FLAGS).
/// A run that names no --task trains the blocks alone (block_task()).
inline CommandResult run_stage(const std::string& stage, int ranks, const std::string& args,
                               const TempDir& dir) {
  const std::string cmd = std::string(kRootMpiEnv) + " timeout 120 " + TPX_MPIEXEC + " " +
                          TPX_MPIEXEC_FLAGS + " -np " + std::to_string(ranks) + " " +
                          stage_binary(stage) + " " + block_task(args);
  return run_command(cmd, dir);
}
#endif

}  // namespace tpx::test
