// Output files are whole or absent: a failed write (full device, file size limit, an exception
// half-way) leaves no file and no temporary behind, and an existing file keeps its old content;
// output paths and --dump directories are checked before a run, and a reused --dump directory
// loses only the files a stage writes there.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/npy.h"
#include "common/output.h"
#include "test_util.h"

namespace tpx {
namespace {

namespace fs = std::filesystem;

/// The names in a directory, sorted (hidden files included: that is where temporaries hide).
std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

/// Whether `text` contains `part`, saying what it was when not.
::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

void put(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

/// The message of the tpx::Error that `f` throws ("" if it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

/// Limits the size of the files this process writes to `bytes` while it lives: a write past the
/// limit then fails with EFBIG ("File too large") instead of raising SIGXFSZ.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    if (getrlimit(RLIMIT_FSIZE, &old_) != 0) fail("getrlimit failed");
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit limit = old_;
    limit.rlim_cur = std::min(bytes, old_.rlim_max);
    if (setrlimit(RLIMIT_FSIZE, &limit) != 0) fail("setrlimit failed");
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, old_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit old_{};
  void (*old_handler_)(int) = SIG_DFL;
};

TEST(AtomicOutput, WritesTheWholeContentWithTheUsualPermissions) {
  const test::TempDir dir;
  write_text_file(dir / "a.json", "{\"x\": 1}\n");
  EXPECT_EQ(test::read_file(dir / "a.json"), "{\"x\": 1}\n");
  write_text_file(dir / "a.json", "{}\n");  // replaces an existing file
  EXPECT_EQ(test::read_file(dir / "a.json"), "{}\n");
  write_file_atomically(dir / "b.bin", [](OutputFile& f) {
    EXPECT_EQ(f.path().filename(), "b.bin");
    for (int i = 0; i < 1000; ++i) f.write("0123456789");
    f.write("!", 1);
  });
  std::string digits;
  for (int i = 0; i < 1000; ++i) digits += "0123456789";
  EXPECT_EQ(test::read_file(dir / "b.bin"), digits + "!");
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"a.json", "b.bin"}));

  // The same mode as any file the process creates (0666 less the umask), not mkstemp's 0600.
  const int fd = ::open((dir / "reference").c_str(), O_WRONLY | O_CREAT | O_EXCL, 0666);
  ASSERT_GE(fd, 0);
  ::close(fd);
  struct stat want {
  }, got{};
  ASSERT_EQ(::stat((dir / "reference").c_str(), &want), 0);
  ASSERT_EQ(::stat((dir / "a.json").c_str(), &got), 0);
  EXPECT_EQ(got.st_mode & 0777, want.st_mode & 0777);
}

TEST(AtomicOutput, AFullDeviceIsAnErrorNamingThePathAndTheReason) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "/dev/full does not exist on this system";
  const std::string message = error_of([] { write_text_file("/dev/full", "{}\n"); });
  EXPECT_TRUE(Contains(message, "cannot write '/dev/full'"));
  EXPECT_TRUE(Contains(message, "No space left on device"));
  // A small .npy too, whose bytes a buffered stream would hold until an unchecked close.
  const std::vector<float> data(4, 1.0f);
  EXPECT_TRUE(
      Contains(error_of([&] { write_npy("/dev/full", data, {4}); }), "No space left on device"));
  // Devices are written in place, never replaced by a regular file.
  EXPECT_TRUE(fs::is_character_file("/dev/full"));
  write_text_file("/dev/null", "discarded\n");
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
}

TEST(AtomicOutput, AWriteThatFailsHalfWayLeavesNoFileAndKeepsAnOldOne) {
  const test::TempDir dir;
  put(dir / "old.json", "old content\n");
  put(dir / "old.npy", "old npy\n");
  const std::string big(1 << 20, 'x');
  const std::vector<float> data(1 << 18, 2.0f);
  std::string new_error, old_error, npy_error, old_npy_error;
  {
    const FileSizeLimit limit(64 * 1024);
    new_error = error_of([&] { write_text_file(dir / "new.json", big); });
    old_error = error_of([&] { write_text_file(dir / "old.json", big); });
    npy_error = error_of([&] { write_npy(dir / "new.npy", data, {1 << 18}); });
    old_npy_error = error_of([&] { write_npy(dir / "old.npy", data, {1 << 18}); });
  }
  EXPECT_TRUE(Contains(new_error, "cannot write '" + (dir / "new.json").string() + "'"));
  EXPECT_TRUE(Contains(new_error, "File too large"));
  EXPECT_TRUE(Contains(old_error, "File too large"));
  EXPECT_TRUE(Contains(npy_error, "cannot write '" + (dir / "new.npy").string() + "'"));
  EXPECT_TRUE(Contains(old_npy_error, "File too large"));
  // No file under a new name, the old ones intact, and no temporary left behind.
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"old.json", "old.npy"}));
  EXPECT_EQ(test::read_file(dir / "old.json"), "old content\n");
  EXPECT_EQ(test::read_file(dir / "old.npy"), "old npy\n");
}

TEST(AtomicOutput, AnExceptionWhileFillingLeavesNoFileAndPropagates) {
  const test::TempDir dir;
  put(dir / "old.json", "old content\n");
  const auto half_then_throw = [](OutputFile& f) {
    f.write("{\"half\": ");
    throw std::runtime_error("the producer failed");
  };
  EXPECT_THROW(write_file_atomically(dir / "new.json", half_then_throw), std::runtime_error);
  EXPECT_THROW(write_file_atomically(dir / "old.json", half_then_throw), std::runtime_error);
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"old.json"});
  EXPECT_EQ(test::read_file(dir / "old.json"), "old content\n");
}

TEST(AtomicOutput, ASymlinkStaysALinkAndItsTargetIsReplaced) {
  const test::TempDir dir;
  fs::create_directory(dir / "real");
  put(dir / "real" / "out.json", "old\n");
  fs::create_symlink(dir / "real" / "out.json", dir / "link.json");
  write_text_file(dir / "link.json", "new\n");
  EXPECT_TRUE(fs::is_symlink(dir / "link.json"));
  EXPECT_EQ(test::read_file(dir / "real" / "out.json"), "new\n");
  EXPECT_EQ(names_in(dir / "real"), std::vector<std::string>{"out.json"});
}

TEST(AtomicOutput, WriteNpyIntoAMissingDirectoryOrOntoADirectoryNamesThePath) {
  const test::TempDir dir;
  const std::vector<float> data(3, 1.0f);
  const fs::path missing = dir / "missing" / "x.npy";
  const std::string message = error_of([&] { write_npy(missing, data, {3}); });
  EXPECT_TRUE(Contains(message, "cannot write '" + missing.string() + "'"));
  EXPECT_TRUE(Contains(message, "No such file or directory"));
  fs::create_directory(dir / "sub");
  EXPECT_TRUE(Contains(error_of([&] { write_npy(dir / "sub", data, {3}); }), "Is a directory"));
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"sub"});
}

TEST(OutputFileProblem, NamesTheFlagThePathAndWhy) {
  const test::TempDir dir;
  EXPECT_EQ(
      output_file_problem("--json", "/nonexistent-tpx-dir/x.json"),
      "--json '/nonexistent-tpx-dir/x.json': directory '/nonexistent-tpx-dir' does not exist");
  fs::create_directory(dir / "sub");
  EXPECT_TRUE(Contains(output_file_problem("--trace", dir / "sub"), "is a directory"));
  EXPECT_TRUE(Contains(output_file_problem("--trace", dir / "sub"),
                       "--trace '" + (dir / "sub").string() + "'"));
  put(dir / "file", "x");
  EXPECT_TRUE(Contains(output_file_problem("--json", dir / "file" / "x.json"), "--json '"));
  EXPECT_EQ(output_file_problem("--json", ""), "--json: the path is empty");
}

TEST(OutputFileProblem, AcceptsAWritablePathAndLeavesNoProbeBehind) {
  const test::TempDir dir;
  EXPECT_EQ(output_file_problem("--json", dir / "x.json"), "");
  put(dir / "existing.json", "keep\n");
  EXPECT_EQ(output_file_problem("--json", dir / "existing.json"), "");
  EXPECT_EQ(output_file_problem("--json", "/dev/null"), "");
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"existing.json"});
  EXPECT_EQ(test::read_file(dir / "existing.json"), "keep\n");
}

TEST(OutputFileProblem, AnUnwritableDirectoryIsReported) {
  if (::geteuid() == 0) GTEST_SKIP() << "running as root, which permissions do not stop";
  const test::TempDir dir;
  fs::create_directory(dir / "ro");
  fs::permissions(dir / "ro", fs::perms(0555));
  EXPECT_TRUE(Contains(output_file_problem("--json", dir / "ro" / "x.json"), "Permission denied"));
  EXPECT_TRUE(Contains(prepare_dump_dir(dir / "ro"), "Permission denied"));
  EXPECT_TRUE(Contains(error_of([&] { write_text_file(dir / "ro" / "x.json", "{}"); }),
                       "Permission denied"));
  fs::permissions(dir / "ro", fs::perms(0755));
  EXPECT_TRUE(fs::is_empty(dir / "ro"));
}

/// Fills a dump directory with what a small run would write: input.npy and fp8/layers.0.wq.npy.
void small_dump(const fs::path& staging) {
  put(staging / "input.npy", "new");
  fs::create_directory(staging / "fp8");
  put(staging / "fp8" / "layers.0.wq.npy", "new");
}

TEST(WriteDumpDir, ReplacesAnEarlierRunsFilesAndKeepsTheUsers) {
  const test::TempDir parent;
  const fs::path dir = parent / "dump";
  fs::create_directory(dir);
  const std::vector<std::string> stale = {"input.npy",
                                          "target.npy",
                                          "output.npy",
                                          "input.grad.npy",
                                          "loss.npy",
                                          "config.json",
                                          "layers.0.norm1.npy",
                                          "layers.1.wq.npy",
                                          "layers.1.wq.grad.npy",
                                          "layers.12.w_down.grad.npy",
                                          ".layers.1.w_gate.npy.tmp-Ab12Cd",
                                          ".config.json.tmp-zzzzzz"};
  const std::vector<std::string> kept = {
      "notes.txt",     "layers.x.txt", "layers.1.wq.txt",      "layers.1.bias.npy",
      "input.npy.bak", "my_input.npy", ".notes.txt.tmp-Ab12Cd"};
  for (const auto& name : stale) put(dir / name, "stale");
  for (const auto& name : kept) put(dir / name, "mine");
  fs::create_directory(dir / "fp8");
  put(dir / "fp8" / "layers.0.wq.scale.npy", "stale");
  put(dir / "fp8" / "layers.0.qkv_in.npy", "stale");
  put(dir / "fp8" / "README", "mine");
  fs::create_directory(dir / "plots");
  put(dir / "plots" / "loss.npy", "mine");  // not the stage's: it writes no subdirectory but fp8/

  EXPECT_EQ(prepare_dump_dir(dir), "");
  EXPECT_EQ(test::read_file(dir / "layers.1.wq.npy"), "stale");  // nothing changes before the end
  write_dump_dir(dir, small_dump);
  std::vector<std::string> want = kept;
  for (const char* name : {"plots", "input.npy", "fp8"}) want.push_back(name);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(names_in(dir), want);
  EXPECT_EQ(test::read_file(dir / "input.npy"), "new");
  EXPECT_EQ(names_in(dir / "fp8"), (std::vector<std::string>{"README", "layers.0.wq.npy"}));
  EXPECT_EQ(names_in(dir / "plots"), std::vector<std::string>{"loss.npy"});
  EXPECT_EQ(names_in(parent.path()), std::vector<std::string>{"dump"});  // no temporary left
}

TEST(WriteDumpDir, MakesTheDirectoryAndAFailedWriteLeavesTheOldOneWhole) {
  const test::TempDir parent;
  const fs::path dir = parent / "dump";
  write_dump_dir(dir / "", small_dump);  // a trailing separator names the same directory
  EXPECT_EQ(names_in(dir), (std::vector<std::string>{"fp8", "input.npy"}));
  const auto interrupted = [](const fs::path& staging) {
    put(staging / "input.npy", "partial");
    throw Error("interrupted");
  };
  EXPECT_EQ(error_of([&] { write_dump_dir(dir, interrupted); }), "interrupted");
  EXPECT_EQ(test::read_file(dir / "input.npy"), "new");
  EXPECT_EQ(names_in(parent.path()), std::vector<std::string>{"dump"});
}

// A --dump directory is made only when the dump is written: checking it creates nothing, so a
// refused or killed run leaves no empty directory behind.
TEST(PrepareDumpDir, CreatesNothingAndRejectsAFile) {
  const test::TempDir dir;
  EXPECT_EQ(prepare_dump_dir(dir / "a" / "b"), "");
  EXPECT_FALSE(fs::exists(dir / "a"));
  EXPECT_TRUE(fs::is_empty(dir.path()));  // the probe is gone
  write_dump_dir(dir / "a" / "b", [](const fs::path& d) { put(d / "config.json", "{}"); });
  EXPECT_EQ(test::read_file(dir / "a" / "b" / "config.json"), "{}");
  put(dir / "file", "x");
  EXPECT_EQ(prepare_dump_dir(dir / "file"),
            "--dump '" + (dir / "file").string() + "': is not a directory");
  EXPECT_EQ(test::read_file(dir / "file"), "x");
  EXPECT_TRUE(Contains(prepare_dump_dir(dir / "file" / "sub"), "is not a directory"));
}

TEST(OutputCollision, SameFileInsideTheDumpOrOverAnInput) {
  const test::TempDir dir;
  put(dir / "in.json", "{}");
  fs::create_symlink(dir / "in.json", dir / "link.json");
  EXPECT_EQ(output_collision({{"--json", dir / "a.json"}, {"--trace", dir / "b.json"}}), "");
  EXPECT_TRUE(
      Contains(output_collision({{"--json", dir / "a"}, {"--trace", dir / "x" / ".." / "a"}}),
               "is the same file as --json"));
  EXPECT_TRUE(Contains(
      output_collision({{"--dump", dir / "d", true}, {"--json", dir / "d" / "config.json"}}),
      "lies inside --dump"));
  EXPECT_TRUE(Contains(output_collision({{"--csv", dir / "link.json"}}, {{"", dir / "in.json"}}),
                       "would overwrite the input"));
  EXPECT_TRUE(fs::exists(dir / "in.json"));
}

}  // namespace
}  // namespace tpx
