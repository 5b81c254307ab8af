// A stage's output paths as a user meets them under mpirun (output.h's rule):
//   - `--dump .` and any existing --dump directory are written in place: the directory keeps its
//     inode and mode, the user's files stay, the same --dump again works, and two jobs writing it
//     at once leave one run's whole dump;
//   - a --dump through a symlink writes the directory it names; a --json or --dump symlink that
//     names nothing, and a kernel file under /proc, are refused before the first step;
//   - a run killed mid-dump leaves a temporary that the next run removes, and a write that fails
//     under the file-size limit names the user's path, not the staging one.
#include <sys/stat.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "test_stage_runs.h"
#include "test_util.h"

namespace tpx {
namespace {

namespace fs = std::filesystem;
using test::CommandResult;
using test::TempDir;

constexpr const char* kSmall =
    "--hidden 32 --heads 4 --ffn 64 --seq 8 --batch 2 --layers 1 --steps 1";

/// `mpirun -np 1 01_baseline <args>` run from the directory `cwd`.
CommandResult run_in(const fs::path& cwd, const std::string& args, const TempDir& scratch) {
  return test::run_command(fmt::format("cd '{}' && {} timeout 120 {} {} -np 1 {} {}", cwd.string(),
                                       test::kRootMpiEnv, TPX_MPIEXEC, TPX_MPIEXEC_FLAGS,
                                       test::stage_binary("01_baseline"), test::block_task(args)),
                           scratch);
}

/// `01_baseline <args>` as a singleton MPI job (no mpirun, which would reset the signals the
/// shell ignores) from the directory `cwd`, after the shell text `limits` (a ulimit, a trap).
CommandResult run_alone_in(const fs::path& cwd, const std::string& args, const TempDir& scratch,
                           const std::string& limits) {
  return test::run_command(
      fmt::format("cd '{}' && {} {} timeout 120 {} {}", cwd.string(), limits, test::kRootMpiEnv,
                  test::stage_binary("01_baseline"), test::block_task(args)),
      scratch);
}

/// The inode and permission bits of `path`.
std::pair<ino_t, mode_t> identity(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {0, 0};
  return {st.st_ino, st.st_mode & 07777};
}

/// The hidden entries of `dir` whose name holds ".tmp-": temporaries.
std::vector<std::string> temporaries_in(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with(".") && name.find(".tmp-") != std::string::npos) out.push_back(name);
  }
  return out;
}

TEST(DumpPaths, TheCurrentDirectoryIsWrittenInPlaceAndAgain) {
  const TempDir dir;
  const fs::path work = dir / "work";
  fs::create_directory(work);
  fs::permissions(work, fs::perms(0750));
  std::ofstream(work / "notes.txt") << "mine";
  const auto before = identity(work);
  for (int run = 0; run < 2; ++run) {  // the second finds the first's dump there
    // `ls` in the same shell afterwards: the shell's directory must still be the one it named.
    const auto r = run_in(work, fmt::format("{} --dump . && ls notes.txt", kSmall), dir);
    ASSERT_EQ(r.exit_code, 0) << "run " << run << "\n" << r.out << r.err;
    EXPECT_EQ(identity(work), before) << "run " << run << ": the directory was replaced";
    EXPECT_EQ(test::read_file(work / "notes.txt"), "mine");
    EXPECT_TRUE(fs::exists(work / "layers.0.wq.grad.npy"));
    EXPECT_TRUE(fs::exists(work / "config.json"));
    EXPECT_TRUE(temporaries_in(work).empty());
  }
  EXPECT_EQ(test::read_file(work / "notes.txt"), "mine");
}

TEST(DumpPaths, ASymlinkToADirectoryIsWrittenThrough) {
  const TempDir dir;
  fs::create_directory(dir / "real");
  fs::create_directory_symlink("real", dir / "link");
  const auto r = run_in(dir.path(), fmt::format("{} --dump link", kSmall), dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(fs::is_symlink(dir / "link"));
  EXPECT_TRUE(fs::exists(dir / "real" / "layers.0.wq.grad.npy"));
  EXPECT_TRUE(temporaries_in(dir.path()).empty());
}

TEST(DumpPaths, WhatCannotBeWrittenIsRefusedBeforeTheFirstStep) {
  const TempDir dir;
  fs::create_symlink(dir / "nowhere.json", dir / "dangling.json");
  fs::create_symlink(dir / "nowhere", dir / "dangling");
  const std::string small(kSmall);
  const auto refused = [&](const std::string& args, const std::string& words) {
    const auto r = test::expect_refused_once("01_baseline", 1, small + " " + args, words);
    EXPECT_EQ(r.out.find("grad norm"), std::string::npos) << "it started training:\n" << r.out;
  };
  if (fs::exists("/proc/version"))
    refused("--json /proc/version", "--json '/proc/version': is a kernel file under /proc");
  refused("--json " + (dir / "dangling.json").string(),
          "is a symbolic link to '" + (dir / "nowhere.json").string() + "', which does not exist");
  refused("--trace " + (dir / "dangling.json").string(), "--trace '");
  refused("--dump " + (dir / "dangling").string(), "which does not exist");
  EXPECT_TRUE(fs::is_symlink(dir / "dangling.json")) << "the link was replaced";
  EXPECT_FALSE(fs::exists(dir / "nowhere.json"));
  EXPECT_FALSE(fs::exists(dir / "nowhere"));
}

/// The regular files under `dir`, relative to it, with their bytes; `except` left out.
std::map<std::string, std::string> files_in(const fs::path& dir, const std::string& except = "") {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file() && e.path().filename() != except)
      out[fs::relative(e.path(), dir).string()] = test::read_file(e.path());
  return out;
}

// Written in place, an existing directory still ends with one run's whole dump when two jobs
// write it at once (their moves take the directory's lock in turn), and keeps the user's file.
TEST(DumpPaths, TwoJobsIntoAnExistingDirectoryLeaveOneRunsWholeSet) {
  const TempDir dir;
  fs::create_directory(dir / "shared");
  std::ofstream(dir / "shared" / "notes.txt") << "mine";
  const auto job = [&](int seed, const std::string& dump) {
    return fmt::format("{} timeout 120 {} {} -np 1 {} {} --seed {} --dump {}", test::kRootMpiEnv,
                       TPX_MPIEXEC, TPX_MPIEXEC_FLAGS, test::stage_binary("01_baseline"), kSmall,
                       seed, (dir / dump).string());
  };
  for (int seed : {1, 2})
    ASSERT_EQ(test::run_command(job(seed, fmt::format("alone{}", seed)), dir).exit_code, 0);
  const auto r = test::run_command(
      fmt::format("{} > /dev/null & a=$!; {} > /dev/null; b=$?; wait $a; echo $? $b",
                  job(1, "shared"), job(2, "shared")),
      dir);
  EXPECT_EQ(r.out, "0 0\n") << r.err;
  const auto got = files_in(dir / "shared", "notes.txt");
  EXPECT_TRUE(got == files_in(dir / "alone1") || got == files_in(dir / "alone2"))
      << "the dump is neither run's whole dump (" << got.size() << " files)";
  EXPECT_EQ(test::read_file(dir / "shared" / "notes.txt"), "mine");
  EXPECT_TRUE(temporaries_in(dir / "shared").empty());
}

// A rank killed mid-dump (here by SIGXFSZ at the file-size limit, as kill -9 would) cannot remove
// its staging directory; the next run's does. A write that fails at that limit (SIGXFSZ ignored:
// EFBIG) names the file under the user's --dump directory.
TEST(DumpPaths, AKilledDumpsTemporaryGoesAndAFailedWriteNamesTheUsersPath) {
  const TempDir dir;
  // One 16 MiB weight (w_gate, [512, 8192] float32) under an 8 MiB limit; MPI starts under it.
  const std::string big =
      "--hidden 512 --heads 4 --ffn 8192 --seq 8 --batch 1 --layers 1 --steps 1 --dump d";
  const auto killed = run_alone_in(dir.path(), big, dir, "ulimit -f 8192;");
  EXPECT_NE(killed.exit_code, 0) << killed.out << killed.err;
  const auto left = temporaries_in(dir.path());
  ASSERT_EQ(left.size(), 1u) << "the killed run's staging directory\n" << killed.err;
  EXPECT_TRUE(left[0].starts_with(".d.tmp-")) << left[0];

  const auto failed = run_alone_in(dir.path(), big, dir, "trap '' XFSZ; ulimit -f 8192;");
  EXPECT_EQ(failed.exit_code, 1) << failed.out << failed.err;
  EXPECT_NE(
      failed.err.find("01_baseline: error: cannot write 'd/layers.0.w_gate.npy': File too large"),
      std::string::npos)
      << failed.err;
  EXPECT_TRUE(temporaries_in(dir.path()).empty()) << "the killed run's temporary stayed";
  EXPECT_FALSE(fs::exists(dir / "d"));
}

}  // namespace
}  // namespace tpx
