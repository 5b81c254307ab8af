// Output files are whole or absent: a failed write (full device, file size limit, an exception
// half-way) leaves no file and no temporary behind, and an existing file keeps its old content;
// output paths and --dump directories are checked before a run, under one rule for symlinks and
// /proc; a reused --dump directory is written in place (its inode, mode and other files stay)
// and loses only the files a stage writes there; a writer killed mid-write leaves a temporary
// that the next writer removes.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
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
                                          "layers.12.w_down.grad.npy"};
  // Not the stage's, nor temporaries of a writer known to be dead: they stay.
  const std::vector<std::string> kept = {
      "notes.txt",     "layers.x.txt", "layers.1.wq.txt",       "layers.1.bias.npy",
      "input.npy.bak", "my_input.npy", ".notes.txt.tmp-Ab12Cd", ".layers.1.w_gate.npy.tmp-Ab12Cd"};
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
  for (const auto& name : kept) EXPECT_EQ(test::read_file(dir / name), "mine") << name;
  EXPECT_EQ(names_in(dir / "fp8"), (std::vector<std::string>{"README", "layers.0.wq.npy"}));
  EXPECT_EQ(names_in(dir / "plots"), std::vector<std::string>{"loss.npy"});
  EXPECT_EQ(names_in(parent.path()), std::vector<std::string>{"dump"});  // no temporary left
}

/// The inode and permission bits of `path`.
std::pair<ino_t, mode_t> identity(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {0, 0};
  return {st.st_ino, st.st_mode & 07777};
}

/// Runs in `dir` while it lives, then back where it was.
class InDirectory {
 public:
  explicit InDirectory(const fs::path& dir) : old_(fs::current_path()) { fs::current_path(dir); }
  ~InDirectory() { fs::current_path(old_); }
  InDirectory(const InDirectory&) = delete;
  InDirectory& operator=(const InDirectory&) = delete;

 private:
  fs::path old_;
};

// A dump into an existing directory writes in place: the directory is the same one afterwards
// (inode, mode), a user's files are untouched, and the calling process's working directory still
// exists. Again into the same directory, after a larger run, it replaces that run's files.
TEST(WriteDumpDir, AnExistingDirectoryIsWrittenInPlaceNeverReplaced) {
  const test::TempDir parent;
  const fs::path dir = parent / "work";
  fs::create_directory(dir);
  fs::permissions(dir, fs::perms(0710));
  put(dir / "notes.txt", "mine");
  const auto before = identity(dir);
  const auto larger = [](const fs::path& staging) {
    put(staging / "input.npy", "first");
    put(staging / "layers.1.wq.npy", "first");
  };
  {
    const InDirectory in(dir);
    EXPECT_EQ(prepare_dump_dir("."), "");
    write_dump_dir(".", larger);
    EXPECT_TRUE(fs::exists(fs::current_path() / "notes.txt")) << "the working directory went";
    write_dump_dir(".", small_dump);  // the same --dump again: a previous dump's files only
  }
  EXPECT_EQ(identity(dir), before) << "the directory was replaced";
  EXPECT_EQ(names_in(dir), (std::vector<std::string>{"fp8", "input.npy", "notes.txt"}));
  EXPECT_EQ(test::read_file(dir / "input.npy"), "new");
  EXPECT_EQ(test::read_file(dir / "notes.txt"), "mine");
  EXPECT_EQ(names_in(parent.path()), std::vector<std::string>{"work"});
  // An existing fp8/ is written into, not replaced, either.
  const auto fp8_before = identity(dir / "fp8");
  write_dump_dir(dir, small_dump);
  EXPECT_EQ(identity(dir / "fp8"), fp8_before);
  EXPECT_EQ(identity(dir), before);
}

// A directory that only its owner can reach keeps that: the dump needs no write access to its
// parent, as a dump beside it would.
TEST(WriteDumpDir, AnExistingDirectoryNeedsNoRoomBesideIt) {
  if (::geteuid() == 0) GTEST_SKIP() << "running as root, which permissions do not stop";
  const test::TempDir parent;
  fs::create_directories(parent / "ro" / "dump");
  fs::permissions(parent / "ro", fs::perms(0555));
  EXPECT_EQ(prepare_dump_dir(parent / "ro" / "dump"), "");
  write_dump_dir(parent / "ro" / "dump", small_dump);
  fs::permissions(parent / "ro", fs::perms(0755));
  EXPECT_EQ(names_in(parent / "ro" / "dump"), (std::vector<std::string>{"fp8", "input.npy"}));
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

// One rule for every output path: a symlink is followed to what it names, and the link stays;
// a link to nothing is refused before any work, by the check and by the write alike.
TEST(OutputPaths, ASymlinkToADirectoryIsADumpIntoThatDirectory) {
  const test::TempDir dir;
  fs::create_directory(dir / "real");
  put(dir / "real" / "notes.txt", "mine");
  fs::create_directory_symlink("real", dir / "link");
  const auto before = identity(dir / "real");
  EXPECT_EQ(prepare_dump_dir(dir / "link"), "");
  write_dump_dir(dir / "link", small_dump);
  EXPECT_TRUE(fs::is_symlink(dir / "link"));
  EXPECT_EQ(identity(dir / "real"), before);
  EXPECT_EQ(names_in(dir / "real"), (std::vector<std::string>{"fp8", "input.npy", "notes.txt"}));
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"link", "real"}));
  // A symlink to a file is no dump directory, for the check as for the write.
  put(dir / "file", "x");
  fs::create_symlink("file", dir / "filelink");
  EXPECT_TRUE(Contains(prepare_dump_dir(dir / "filelink"), "is not a directory"));
  EXPECT_TRUE(
      Contains(error_of([&] { write_dump_dir(dir / "filelink", small_dump); }), "Not a directory"));
}

TEST(OutputPaths, ADanglingSymlinkIsRefusedAndStaysALink) {
  const test::TempDir dir;
  fs::create_symlink(dir / "nowhere.json", dir / "out.json");
  fs::create_symlink(dir / "nowhere", dir / "dump");
  fs::create_symlink("loop", dir / "loop");
  const std::string want =
      "is a symbolic link to '" + (dir / "nowhere.json").string() + "', which does not exist";
  EXPECT_EQ(output_file_problem("--json", dir / "out.json"),
            "--json '" + (dir / "out.json").string() + "': " + want);
  EXPECT_TRUE(Contains(output_file_problem("--trace", dir / "loop"), "is a symbolic link"));
  EXPECT_TRUE(Contains(prepare_dump_dir(dir / "dump"), "which does not exist"));
  EXPECT_TRUE(Contains(prepare_dump_dir(dir / "dump" / "sub"), "which does not exist"));
  EXPECT_TRUE(Contains(error_of([&] { write_text_file(dir / "out.json", "{}"); }), want));
  EXPECT_TRUE(Contains(error_of([&] { write_dump_dir(dir / "dump", small_dump); }),
                       "which does not exist"));
  EXPECT_TRUE(fs::is_symlink(dir / "out.json"));
  EXPECT_TRUE(fs::is_symlink(dir / "dump"));
  EXPECT_EQ(names_in(dir.path()), (std::vector<std::string>{"dump", "loop", "out.json"}));
}

TEST(OutputPaths, AKernelFileUnderProcIsRefusedADescriptorIsNot) {
  if (!fs::exists("/proc/version")) GTEST_SKIP() << "this system has no /proc";
  EXPECT_EQ(output_file_problem("--json", "/proc/version"),
            "--json '/proc/version': is a kernel file under /proc, which cannot hold an output");
  EXPECT_TRUE(Contains(error_of([] { write_text_file("/proc/version", "{}"); }),
                       "cannot write '/proc/version': is a kernel file"));
  EXPECT_TRUE(Contains(prepare_dump_dir("/proc/version"), "is a kernel file"));
  const test::TempDir dir;
  fs::create_symlink("/proc/version", dir / "link.json");
  EXPECT_TRUE(Contains(output_file_problem("--json", dir / "link.json"), "is a kernel file"));
  // A descriptor's name is written in place (what /dev/stdout names).
  const int fd = ::open((dir / "log").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0666);
  ASSERT_GE(fd, 0);
  const fs::path name = fs::path("/proc/self/fd") / std::to_string(fd);
  EXPECT_EQ(output_file_problem("--json", name), "");
  write_text_file(name, "{}\n");
  ::close(fd);
  EXPECT_EQ(test::read_file(dir / "log"), "{}\n");
}

/// Runs `write` in a child process that dies (as by kill -9: no clean-up) once `fill` is
/// reached, and returns the child's pid after it has died.
template <class Write>
pid_t die_while_writing(Write&& write) {
  const pid_t child = ::fork();
  if (child == 0) {
    write();
    ::_exit(3);  // not reached: the fill dies first
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return child;
}

// A writer that dies mid-write leaves its temporary, named with its host and pid; the next
// writer into that directory (or the start-up check) removes it, and only it: a live writer's
// and another host's temporaries stay.
TEST(OutputPaths, ADeadWritersTemporariesAreRemovedByTheNextWriter) {
  const test::TempDir dir;
  const pid_t dead = die_while_writing([&] {
    write_file_atomically(dir / "a.json", [](OutputFile& f) {
      f.write("half");
      ::raise(SIGKILL);
    });
  });
  const auto left = names_in(dir.path());
  ASSERT_EQ(left.size(), 1u) << "the killed writer left its temporary";
  const std::string& temp = left[0];
  EXPECT_EQ(temp.rfind(".a.json.tmp-", 0), 0u) << temp;
  EXPECT_TRUE(Contains(temp, "-" + std::to_string(dead) + "-"));
  // A live writer's temporary (this process's pid in the name) and another host's stay.
  const std::string pid_part = "-" + std::to_string(dead) + "-";
  const auto at = temp.find(pid_part);
  const std::string live = temp.substr(0, at) + "-" + std::to_string(::getpid()) + "-" +
                           temp.substr(at + pid_part.size());
  const auto host_at = temp.find(".tmp-") + 5;
  const std::string other_host =
      temp.substr(0, host_at) + "elsewhere0x" + temp.substr(temp.find('-', host_at));
  put(dir / live, "live");
  put(dir / other_host, "other");
  EXPECT_EQ(output_file_problem("--json", dir / "b.json"), "");
  std::vector<std::string> want = {live, other_host};
  std::sort(want.begin(), want.end());
  EXPECT_EQ(names_in(dir.path()), want);

  // A dump's staging directory, beside a new directory or inside an existing one, likewise.
  fs::create_directories(dir / "dumps" / "existing");
  for (const char* name : {"new", "existing"}) {
    const fs::path dump = dir / "dumps" / name;
    const fs::path where = fs::exists(dump) ? dump : dump.parent_path();
    const std::vector<std::string> before = names_in(where);
    const pid_t dead_dump = die_while_writing([&] {
      write_dump_dir(dump, [](const fs::path& staging) {
        put(staging / "input.npy", "half");
        ::raise(SIGKILL);
      });
    });
    const auto now = names_in(where);
    ASSERT_EQ(now.size(), before.size() + 1) << name;
    bool found = false;
    for (const auto& n : now)
      found = found || (Contains(n, "-" + std::to_string(dead_dump) + "-") && n[0] == '.');
    EXPECT_TRUE(found) << name;
    EXPECT_EQ(prepare_dump_dir(dump), "");
    EXPECT_EQ(names_in(where), before) << name;
  }
}

// A write that fails inside a dump (the file size limit) names the file as the user knows it,
// under the --dump directory, not under the staging directory it was written in.
TEST(OutputPaths, AFailedDumpWriteNamesTheUsersPath) {
  const test::TempDir dir;
  fs::create_directory(dir / "old");
  const std::vector<float> data(1 << 18, 2.0f);
  const auto big = [&](const fs::path& staging) {
    write_npy(staging / "layers.0.wq.npy", data, {1 << 18});
  };
  std::string new_error, old_error;
  {
    const FileSizeLimit limit(64 * 1024);
    new_error = error_of([&] { write_dump_dir(dir / "new", big); });
    old_error = error_of([&] { write_dump_dir(dir / "old", big); });
  }
  EXPECT_EQ(new_error,
            "cannot write '" + (dir / "new" / "layers.0.wq.npy").string() + "': File too large");
  EXPECT_EQ(old_error,
            "cannot write '" + (dir / "old" / "layers.0.wq.npy").string() + "': File too large");
  EXPECT_EQ(names_in(dir.path()), std::vector<std::string>{"old"});
  EXPECT_TRUE(fs::is_empty(dir / "old"));
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
      "lies inside --dump '" + (dir / "d").string() + "' under a name the dump writes"));
  EXPECT_TRUE(Contains(output_collision({{"--trace", dir / "d" / "fp8" / "layers.0.wq.npy"},
                                         {"--dump", dir / "d", true}}),
                       "('fp8/layers.0.wq.npy')"));
  EXPECT_TRUE(Contains(
      output_collision({{"--dump", dir / "d", true}}, {{"--config", dir / "d" / "loss.npy"}}),
      "the input --config"));
  // The dump writes in place: the user's own names in its directory are apart from it.
  EXPECT_EQ(output_collision({{"--dump", dir / "d", true}, {"--json", dir / "d" / "run.json"}},
                             {{"--config", dir / "d" / "my.json"}}),
            "");
  EXPECT_TRUE(Contains(output_collision({{"--csv", dir / "link.json"}}, {{"", dir / "in.json"}}),
                       "would overwrite the input"));
  EXPECT_TRUE(fs::exists(dir / "in.json"));
}

}  // namespace
}  // namespace tpx
