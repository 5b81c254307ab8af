// Output files that are whole or absent. --json, --trace and --dump files are written into a
// temporary file next to the final name (".<name>.tmp-XXXXXX") and renamed over it only once every
// byte is written, fsync'ed and the file closed, so a reader (or a later run) never sees half a
// file: on a full disk the final name keeps its old content, or stays absent. Every write, fsync,
// close and rename is checked (POSIX calls; writes loop over EINTR and short writes) and a failure
// throws tpx::Error "cannot write '<path>': <strerror>".
//
// A --dump directory is whole or absent in the same way, as a set: its files are written into a
// fresh temporary directory beside it (".<name>.tmp-XXXXXX") that replaces it in one rename once
// complete (write_dump_dir), so two jobs writing one directory leave one job's whole dump, and a
// crash mid-write leaves no partial dump under the directory's name.
//
// The paths are also checked before training starts (output_file_problem, prepare_dump_dir), so a
// typo in a directory costs a one-line error, not a run.
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
/// Special cases: a symlink to a regular file stays a link (its target is replaced); a path that
/// exists and is not a regular file (/dev/null, /dev/full, a FIFO, a directory), or lies under
/// /dev or /proc (/dev/stdout), cannot be replaced by a rename and is written directly, with the
/// same checks, so `--json /dev/full` fails with "No space left on device".
void write_file_atomically(const std::filesystem::path& path,
                           const std::function<void(OutputFile&)>& fill);

/// write_file_atomically() with `text` as the whole content.
void write_text_file(const std::filesystem::path& path, std::string_view text);

/// Empty if write_file_atomically(path) can create its file: the directory exists and a file can
/// be created in it, and `path` is not a directory (an existing device must be writable).
/// Otherwise one sentence naming the flag, the path and why, e.g. "--json '/nonexistent/x.json':
/// directory '/nonexistent' does not exist". Creates and removes a probe file in the directory;
/// creates no directories.
std::string output_file_problem(std::string_view flag, const std::filesystem::path& path);

/// Checks that a --dump directory can be written, creating nothing: an existing `dir` must be a
/// directory in which files can be created, with room for a temporary directory beside it; a
/// missing one must have an existing ancestor in which a directory can be created (the dump
/// makes it, and its missing parents, only when it is written: a refused or killed run leaves
/// nothing behind). Changes nothing in it: what an earlier run left is replaced when the new dump
/// is complete (write_dump_dir). Returns empty on success, else one sentence naming --dump, the
/// directory and why.
std::string prepare_dump_dir(const std::filesystem::path& dir);

/// One path a program reads or writes, for output_collision(): the flag that names it, and
/// whether it is a directory (a --dump) whose files are outputs too.
struct NamedPath {
  std::string_view flag;
  std::filesystem::path path;
  bool directory = false;
};

/// Empty when the `outputs` are apart: no two resolve to the same file (symlinks and hard links
/// followed), none lies inside another's directory, and none is one of the `inputs` (or inside
/// an output directory, an input). Otherwise one sentence naming both flags and the file, e.g.
/// "--trace 'x' is the same file as --json 'x': each output needs its own". Creates nothing.
std::string output_collision(const std::vector<NamedPath>& outputs,
                             const std::vector<NamedPath>& inputs = {});

/// Writes the --dump directory `dir` whole or not at all: `fill` writes every file into the
/// directory it is given, a new temporary one beside `dir`, which then takes `dir`'s place in one
/// rename (renameat2's RENAME_EXCHANGE when `dir` exists, so that it is never missing; where the
/// file system cannot exchange, `dir` is renamed aside first). The old directory's files that
/// are not a stage's (anything but input.npy, target.npy, output.npy, input.grad.npy, loss.npy,
/// config.json, layers.L.P[.grad].npy for the nine parameter names P, fp8/layers.L.*.npy, and
/// temporaries of these) move into the new one, so a user's own files stay and a smaller run
/// leaves no stale tensors; then the old directory is removed. On a failure, including an
/// exception from `fill`, the temporary is removed and `dir` is untouched; ours throw tpx::Error
/// "cannot write '<dir>': <reason>".
void write_dump_dir(const std::filesystem::path& dir,
                    const std::function<void(const std::filesystem::path&)>& fill);

}  // namespace tpx
