// Output files that are whole or absent. --json, --trace and --dump files are written into a
// temporary file next to the final name and renamed over it only once every byte is written,
// fsync'ed and the file closed, so a reader (or a later run) never sees half a file: on a full
// disk the final name keeps its old content, or stays absent. Every write, fsync, close and rename
// is checked (POSIX calls; writes loop over EINTR and short writes) and a failure throws tpx::Error
// "cannot write '<path>': <reason>", naming the user's path, never a temporary's.
//
// One rule for every output path (--json, --trace, --dump, a tool's --csv), checked before any
// work (output_file_problem, prepare_dump_dir) and applied alike when writing:
//   - a symlink is followed to what it finally names, which is written; the link itself is never
//     replaced. A symlink that names nothing (dangling, or a loop) is refused: it would have the
//     output created somewhere the user may not expect, or the link replaced by a file;
//   - a path under /dev or /proc is taken as given (/dev/stdout is written, not what it points
//     to) and written in place, as is any existing device, FIFO or socket; it must open for
//     writing. Under /proc only a file descriptor's name (/proc/self/fd/N) can be written: the
//     kernel's own files (/proc/version) are refused;
//   - anything else: a file's directory must exist and take new files; a --dump must be a
//     directory, or one that can be made.
//
// A --dump into an existing directory writes in place and never replaces the directory: its
// inode, mode and owner stay, and so do the files in it that are not a stage's (DESIGN.md's
// names, dump_writes in output.cc); `--dump .` is allowed. The dump is written whole into a hidden
// staging directory inside it first, then each file takes its name in one rename (atomic per
// file), under an exclusive lock on the directory so that two runs' moves do not interleave: after
// both, the directory holds one run's whole set. A crash while filling the staging directory
// leaves the earlier dump as it was; only a crash during the moves (renames only) can leave files
// of both runs. A missing --dump directory is staged beside it and appears in one rename, whole.
//
// Temporaries are named ".<name>.tmp-<host>-<pid>-XXXXXX": the writer's host and process id, and
// six random characters. A process that dies mid-write (kill -9, SIGXFSZ) cannot remove its own,
// so every writer first removes, in the directory it writes into, the temporaries of this naming
// that this host's processes left and whose process no longer exists (another host's, or a live
// writer's, stay).
//
// defines: tpx::OutputFile, tpx::write_file_atomically(), tpx::write_text_file(),
//          tpx::output_file_problem(), tpx::prepare_dump_dir(), tpx::write_dump_dir(),
//          tpx::NamedPath, tpx::output_collision()
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace tpx {

/// A file being written by write_file_atomically(): every write is checked.
class OutputFile {
 public:
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile();

  /// Writes all `bytes`; throws tpx::Error naming the file and the reason.
  void write(const void* data, std::size_t bytes);
  void write(std::string_view text) { write(text.data(), text.size()); }

  /// The name the file is written under (the final one, not the temporary).
  const std::filesystem::path& path() const { return path_; }

 private:
  friend void write_file_atomically(const std::filesystem::path& path,
                                    const std::function<void(OutputFile&)>& fill);
  OutputFile(int fd, std::filesystem::path path) : fd_(fd), path_(std::move(path)) {}
  void sync();   ///< fsync, checked
  void close();  ///< close, checked

  int fd_;
  std::filesystem::path path_;
};

/// Writes `path` whole or not at all: `fill` writes into a new temporary file in the same
/// directory (mode 0666 less the umask, like any new file), which is fsync'ed, closed and renamed
/// over `path`. On any failure, including an exception thrown by `fill`, the temporary is removed
/// and `path` is untouched (an existing file keeps its old content); a failure of ours throws
/// tpx::Error "cannot write '<path>': <reason>", one of `fill` propagates as it is.
///
/// Paths follow the header's rule: a symlink to a regular file stays a link (its target is
/// replaced), a dangling one is refused; a device, FIFO, or a path under /dev or /proc
/// (/dev/stdout) cannot be replaced by a rename and is written directly, with the same checks, so
/// `--json /dev/full` fails with "No space left on device".
void write_file_atomically(const std::filesystem::path& path,
                           const std::function<void(OutputFile&)>& fill);

/// write_file_atomically() with `text` as the whole content.
void write_text_file(const std::filesystem::path& path, std::string_view text);

/// Empty if write_file_atomically(path) can write its file under the header's rule: the directory
/// exists and a file can be created in it, `path` is not a directory, a symlink names something,
/// and a device opens for writing (without being truncated). Otherwise one sentence naming the
/// flag, the path and why, e.g. "--json '/nonexistent/x.json': directory '/nonexistent' does not
/// exist". Creates and removes a probe file in the directory (removing dead writers' temporaries
/// there, as every write does); creates no directories.
std::string output_file_problem(std::string_view flag, const std::filesystem::path& path);

/// Checks that a --dump directory can be written, creating nothing: an existing `dir` (or the
/// directory a symlink names) must be one in which files can be created; a missing one must have
/// an existing ancestor in which a directory can be created (the dump makes it, and its missing
/// parents, only when it is written: a refused or killed run leaves nothing behind). Changes
/// nothing in it but removing dead writers' temporaries: what an earlier run left is replaced when
/// the new dump is complete (write_dump_dir). Returns empty on success, else one sentence naming
/// --dump, the directory and why.
std::string prepare_dump_dir(const std::filesystem::path& dir);

/// One path a program reads or writes, for output_collision(): the flag that names it, and
/// whether it is a directory (a --dump) whose files are outputs too.
struct NamedPath {
  std::string_view flag;
  std::filesystem::path path;
  bool directory = false;
};

/// Empty when the `outputs` are apart: no two resolve to the same file (symlinks and hard links
/// followed), none lies inside a --dump directory under a name the dump writes, and none is one of
/// the `inputs` (nor is an input a dump's file). Otherwise one sentence naming both flags and the
/// file, e.g. "--trace 'x' is the same file as --json 'x': each output needs its own". Creates
/// nothing.
std::string output_collision(const std::vector<NamedPath>& outputs,
                             const std::vector<NamedPath>& inputs = {});

/// Writes the --dump directory `dir` (a symlink followed): `fill` writes every file into the
/// directory it is given, a new staging directory (inside `dir` when it exists, else beside it).
/// A new `dir` then takes its name in one rename. An existing one is never replaced: under an
/// exclusive lock on it, each file moves in by one rename (replacing an earlier run's file of that
/// name), and the stage's files an earlier run left that this one did not write (input.npy,
/// target.npy, output.npy, input.grad.npy, loss.npy, config.json, layers.L.P[.grad].npy for the
/// nine parameter names P, fp8/layers.L.*.npy) are removed, so a smaller run leaves no stale
/// tensors; every other file stays. On a failure while filling, including an exception from
/// `fill`, the staging directory is removed and `dir` is untouched; ours throw tpx::Error
/// "cannot write '<dir>/<file>': <reason>", naming the file by its name in `dir`.
void write_dump_dir(const std::filesystem::path& dir,
                    const std::function<void(const std::filesystem::path&)>& fill);

}  // namespace tpx
