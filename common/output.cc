#include "output.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <charconv>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <regex>
#include <set>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "check.h"
#include "model.h"

namespace tpx {
namespace {

namespace fs = std::filesystem;

/// While a --dump is filled, the files under its staging directory are named in errors by the
/// name they will have: the user's directory, not the staging one.
struct ShownAs {
  fs::path staging;
  fs::path shown;
};
thread_local const ShownAs* shown_as = nullptr;

/// `path` as the user knows it.
fs::path shown_name(const fs::path& path) {
  if (shown_as == nullptr) return path;
  const fs::path rel = path.lexically_relative(shown_as->staging);
  if (rel.empty() || *rel.begin() == "..") return path;
  return rel == "." ? shown_as->shown : shown_as->shown / rel;
}

/// Thrown as it is: the message is the user's one line, with no source location.
[[noreturn]] void fail_write(const fs::path& path, std::string_view why) {
  throw Error(fmt::format("cannot write '{}': {}", shown_name(path).string(), why));
}
[[noreturn]] void fail_write(const fs::path& path, int err) {
  fail_write(path, std::strerror(err));
}

fs::path directory_of(const fs::path& path) {
  fs::path dir = path.parent_path();
  return dir.empty() ? fs::path(".") : dir;
}

/// This host, as a temporary's name records it: the host name's first label, in letters, digits
/// and '-', at most 32 of them.
const std::string& host_tag() {
  static const std::string tag = [] {
    char name[256] = {};
    if (::gethostname(name, sizeof name - 1) != 0) return std::string();
    std::string t;
    for (const char* c = name; *c != '\0' && *c != '.' && t.size() < 32; ++c)
      t += std::isalnum(static_cast<unsigned char>(*c)) != 0 ? *c : '-';
    return t;
  }();
  return tag;
}

/// A temporary's name: ".<name>.tmp-<host>-<pid>-XXXXXX", the writer's host and process id, then
/// six random letters and digits.
const std::regex& temporary_name() {
  static const std::regex name(R"(\.(.+)\.tmp-([A-Za-z0-9-]*)-([0-9]+)-[A-Za-z0-9]{6})");
  return name;
}

/// A new name for a temporary next to `path` (see temporary_name).
fs::path sibling_name(const fs::path& path) {
  static constexpr std::string_view kChars =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 random(std::random_device{}());
  std::string suffix(6, ' ');
  for (char& c : suffix) c = kChars[random() % kChars.size()];
  std::string name = path.filename().string();
  if (name.empty() || name == "." || name == "..") name = "dump";
  return directory_of(path) /
         fmt::format(".{}.tmp-{}-{}-{}", name, host_tag(), static_cast<long>(::getpid()), suffix);
}

/// Removes the temporaries in `dir` that a process of this host left when it died before it
/// could remove them (killed, or out of power): those whose process no longer exists. Others'
/// (a live writer's, another host's) stay.
void remove_stale_temporaries(const fs::path& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::smatch m;
    if (!std::regex_match(name, m, temporary_name()) || m[2].str() != host_tag()) continue;
    long pid = 0;
    if (std::from_chars(name.data() + m.position(3), name.data() + m.position(3) + m.length(3), pid)
                .ec != std::errc() ||
        pid <= 0 || pid > std::numeric_limits<pid_t>::max())
      continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive, or unknown
    std::error_code gone;
    fs::remove_all(it->path(), gone);
  }
}

/// A new, empty file next to `path` (see temporary_name).
struct Temporary {
  int fd = -1;  ///< -1 on failure, with errno set
  fs::path path;
};

/// Creates the temporary with O_EXCL (never an existing file) and mode 0666, so that the umask
/// applies as to any new file (mkstemp's 0600 would make every output private). Stale
/// temporaries in the directory go first.
Temporary create_temporary(const fs::path& path) {
  remove_stale_temporaries(directory_of(path));
  for (int attempt = 0; attempt < 100; ++attempt) {
    fs::path temp = sibling_name(path);
    const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0 || errno != EEXIST) return {fd, std::move(temp)};
  }
  return {};  // errno is EEXIST
}

/// A new, empty directory next to `path` (mode 0777 less the umask); empty path on failure, with
/// errno set. Stale temporaries in the directory go first.
fs::path create_temporary_dir(const fs::path& path) {
  remove_stale_temporaries(directory_of(path));
  for (int attempt = 0; attempt < 100; ++attempt) {
    fs::path temp = sibling_name(path);
    if (::mkdir(temp.c_str(), 0777) == 0) return temp;
    if (errno != EEXIST) return {};
  }
  return {};  // errno is EEXIST
}

/// Creates and removes a temporary next to `path`: 0, or the errno that stopped it.
int probe_directory_of(const fs::path& path) {
  const Temporary probe = create_temporary(path);
  if (probe.fd < 0) return errno;
  ::close(probe.fd);
  ::unlink(probe.path.c_str());
  return 0;
}

/// Whether `path`, made absolute, lies under the top-level directory `top` ("dev", "proc").
bool under(const fs::path& path, std::string_view top) {
  std::error_code ec;
  const fs::path abs = fs::absolute(path, ec).lexically_normal();
  auto it = abs.begin();
  if (ec || it == abs.end() || ++it == abs.end()) return false;
  return *it == top;
}

/// Whether `path` is a file descriptor's name under /proc (/proc/self/fd/1, what /dev/stdout
/// names), the only /proc files an output may be written to.
bool descriptor_name(const fs::path& path) {
  std::error_code ec;
  const fs::path abs = fs::absolute(path, ec).lexically_normal();
  std::vector<std::string> parts;
  for (const auto& part : abs) parts.push_back(part.string());
  return parts.size() == 5 && parts[1] == "proc" && parts[3] == "fd";
}

/// What an output path names, under output.h's rule for symlinks.
struct Target {
  enum Kind {
    missing,    ///< nothing there yet: created
    regular,    ///< a regular file: replaced by a rename
    directory,  ///< a directory
    in_place,   ///< a device, FIFO or socket, or anything under /dev or /proc: written directly
    refused,    ///< a symlink to nothing (or a loop), a kernel file under /proc: `why`
  };
  fs::path path;  ///< the name to write: the path given, or a symlink's final target
  Kind kind;
  std::string why;  ///< for `refused`: what is wrong, e.g. "is a symbolic link to 'x', which ..."
};

Target target_of(const fs::path& path) {
  struct stat st {};
  if (under(path, "dev") || under(path, "proc")) {  // as given: /dev/stdout is not its target
    if (::stat(path.c_str(), &st) != 0) return {path, Target::missing, {}};
    if (under(path, "proc") && !descriptor_name(path) && !S_ISDIR(st.st_mode))
      return {path, Target::refused, "is a kernel file under /proc, which cannot hold an output"};
    return {path, S_ISDIR(st.st_mode) ? Target::directory : Target::in_place, {}};
  }
  if (::lstat(path.c_str(), &st) != 0) return {path, Target::missing, {}};
  if (S_ISLNK(st.st_mode)) {
    // Followed one link at a time, so that a link to /dev/stdout is taken as that name.
    fs::path to = path;
    for (int hops = 0; hops < 40 && ::lstat(to.c_str(), &st) == 0 && S_ISLNK(st.st_mode); ++hops) {
      std::error_code ec;
      const fs::path next = fs::read_symlink(to, ec);
      if (ec) break;
      to = next.is_absolute() ? next : to.parent_path() / next;
      if (under(to, "dev") || under(to, "proc")) return target_of(to);
    }
    if (::lstat(to.c_str(), &st) != 0)
      return {path, Target::refused,
              fmt::format("is a symbolic link to '{}', which does not exist", to.string())};
    if (S_ISLNK(st.st_mode))
      return {path, Target::refused,
              fmt::format("is a symbolic link to '{}': {}", to.string(), std::strerror(ELOOP))};
    return target_of(to);
  }
  if (S_ISREG(st.st_mode)) return {path, Target::regular, {}};
  if (S_ISDIR(st.st_mode)) return {path, Target::directory, {}};
  return {path, Target::in_place, {}};
}

/// The files a stage writes into --dump DIR (DESIGN.md's list).
const std::regex& stage_dump_files() {
  static const std::regex files = [] {
    std::vector<std::string_view> params;
    for (Param p : kAllParams) params.push_back(param_name(p));
    return std::regex(fmt::format(R"((input|target|output|input\.grad|loss)\.npy|config\.json|)"
                                  R"(layers\.\d+\.({})(\.grad)?\.npy)",
                                  fmt::join(params, "|")));
  }();
  return files;
}

/// The files stage 06 writes into --dump DIR/fp8.
const std::regex& fp8_dump_files() {
  static const std::regex files(R"(layers\.\d+\..+\.npy)");
  return files;
}

/// Whether `rel`, a name inside a --dump directory, is one a stage writes (or removes as stale).
bool dump_writes(const fs::path& rel) {
  std::vector<std::string> parts;
  for (const auto& part : rel) parts.push_back(part.string());
  if (parts.size() == 1) return std::regex_match(parts[0], stage_dump_files());
  return parts.size() == 2 && parts[0] == "fp8" && std::regex_match(parts[1], fp8_dump_files());
}

/// `path` as an absolute name with no trailing separator (the name a rename replaces).
fs::path directory_name(const fs::path& path) {
  std::error_code ec;
  fs::path abs = fs::absolute(path, ec).lexically_normal();
  if (abs.filename().empty()) abs = abs.parent_path();
  return abs;
}

}  // namespace

OutputFile::~OutputFile() {
  if (fd_ >= 0) ::close(fd_);  // only after a failure, which is already being reported
}

void OutputFile::write(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail_write(path_, n < 0 ? errno : EIO);
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
}

void OutputFile::sync() {
  if (::fsync(fd_) != 0) fail_write(path_, errno);
}

void OutputFile::close() {
  if (::close(std::exchange(fd_, -1)) != 0) fail_write(path_, errno);
}

void write_file_atomically(const fs::path& path, const std::function<void(OutputFile&)>& fill) {
  const Target target = target_of(path);
  if (target.kind == Target::refused) fail_write(path, target.why);
  if (target.kind == Target::directory) fail_write(path, EISDIR);
  if (target.kind == Target::in_place) {
    int fd = -1;
    do fd = ::open(target.path.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) fail_write(path, errno);
    OutputFile file(fd, path);
    fill(file);
    file.close();
    return;
  }
  const Temporary temp = create_temporary(target.path);
  if (temp.fd < 0) fail_write(path, errno);
  OutputFile file(temp.fd, path);
  try {
    fill(file);
    file.sync();
    file.close();
    if (::rename(temp.path.c_str(), target.path.c_str()) != 0) fail_write(path, errno);
  } catch (...) {
    ::unlink(temp.path.c_str());
    throw;
  }
}

void write_text_file(const fs::path& path, std::string_view text) {
  write_file_atomically(path, [text](OutputFile& file) { file.write(text); });
}

std::string output_file_problem(std::string_view flag, const fs::path& path) {
  const auto problem = [&](std::string_view why) {
    return fmt::format("{} '{}': {}", flag, path.string(), why);
  };
  if (path.empty()) return fmt::format("{}: the path is empty", flag);
  const Target target = target_of(path);
  std::error_code ec;
  switch (target.kind) {
    case Target::refused:
      return problem(target.why);
    case Target::directory:
      return problem("is a directory");
    case Target::in_place: {
      // Opened for writing as the write will, without truncating it: the device must take
      // writes. A FIFO is not opened (that waits for its reader).
      if (::access(target.path.c_str(), W_OK) != 0) return problem(std::strerror(errno));
      if (fs::is_fifo(target.path, ec)) return {};
      const int fd = ::open(target.path.c_str(), O_WRONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
      if (fd < 0) return problem(std::strerror(errno));
      ::close(fd);
      return {};
    }
    case Target::missing:
    case Target::regular:
      break;
  }
  const fs::path dir = directory_of(target.path);
  const fs::file_status st = fs::status(dir, ec);
  if (st.type() == fs::file_type::none)
    return problem(fmt::format("cannot reach directory '{}': {}", dir.string(), ec.message()));
  if (!fs::exists(st)) return problem(fmt::format("directory '{}' does not exist", dir.string()));
  if (!fs::is_directory(st)) return problem(fmt::format("'{}' is not a directory", dir.string()));
  if (const int err = probe_directory_of(target.path); err != 0)
    return problem(fmt::format("cannot create a file in directory '{}': {}", dir.string(),
                               std::strerror(err)));
  return {};
}

std::string prepare_dump_dir(const fs::path& dir) {
  const auto problem = [&](std::string_view why) {
    return fmt::format("--dump '{}': {}", dir.string(), why);
  };
  if (dir.empty()) return "--dump: the path is empty";
  const Target target = target_of(directory_name(dir));
  switch (target.kind) {
    case Target::refused:
      return problem(target.why);
    case Target::regular:
    case Target::in_place:
      return problem("is not a directory");
    case Target::directory: {
      // The dump is staged in a hidden directory inside it (and stale ones are removed).
      const fs::path probe = create_temporary_dir(target.path / target.path.filename());
      if (probe.empty())
        return problem(fmt::format("cannot create files in it: {}", std::strerror(errno)));
      ::rmdir(probe.c_str());
      return {};
    }
    case Target::missing:
      break;
  }
  // The first name on the way down that does not exist yet (the directory itself, or a parent):
  // the dump creates it, so a directory must be creatable in its parent. A symlink on the way
  // that points nowhere is refused as the directory itself would be.
  std::error_code ec;
  fs::path first_missing = target.path;
  for (fs::path p = target.path; !p.empty() && p != p.parent_path(); p = p.parent_path()) {
    if (fs::exists(p, ec)) break;
    if (fs::is_symlink(p, ec)) {
      const Target link = target_of(p);
      return problem(fmt::format("'{}' {}", p.string(), link.why));
    }
    first_missing = p;
  }
  const fs::path parent = first_missing.parent_path();
  if (fs::exists(parent, ec) && !fs::is_directory(parent, ec))
    return problem(fmt::format("'{}' is not a directory", parent.string()));
  const fs::path probe = create_temporary_dir(first_missing);
  if (probe.empty())
    return problem(fmt::format("cannot create a directory in '{}': {}", parent.string(),
                               std::strerror(errno)));
  ::rmdir(probe.c_str());
  return {};
}

namespace {

/// `p` as the file it names: absolute, normal, symlinks resolved where they exist.
fs::path resolved(const fs::path& p) {
  std::error_code ec;
  fs::path r = fs::weakly_canonical(fs::absolute(p, ec), ec);
  if (ec) r = fs::absolute(p, ec).lexically_normal();
  if (r.filename().empty()) r = r.parent_path();
  return r;
}

bool same_file(const fs::path& a, const fs::path& b) {
  if (resolved(a) == resolved(b)) return true;
  std::error_code ec;
  return fs::exists(a, ec) && fs::exists(b, ec) && fs::equivalent(a, b, ec);
}

/// The name `p` has inside the --dump directory `dir` when the dump writes (or removes) a file
/// of that name there, else empty (resolved names).
fs::path dump_file_at(const fs::path& p, const fs::path& dir) {
  const fs::path rel = resolved(p).lexically_relative(resolved(dir));
  if (rel.empty() || *rel.begin() == ".." || !dump_writes(rel)) return {};
  return rel;
}

std::string quoted(const NamedPath& n) {
  if (n.flag.empty()) return fmt::format("'{}'", n.path.string());
  return fmt::format("{} '{}'", n.flag, n.path.string());
}

/// Moves what `from` holds into `to` (both existing directories), one rename per file, making
/// the subdirectories `to` lacks; `written` collects the names moved, relative to `to`.
void move_tree(const fs::path& from, const fs::path& to, const fs::path& shown, const fs::path& rel,
               std::set<fs::path>& written) {
  std::error_code ec;
  for (fs::directory_iterator it(from / rel, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path name = rel / it->path().filename();
    std::error_code entry_ec;
    if (it->symlink_status(entry_ec).type() == fs::file_type::directory) {
      if (::mkdir((to / name).c_str(), 0777) != 0 && errno != EEXIST)
        fail_write(shown / name, errno);
      if (!fs::is_directory(fs::symlink_status(to / name, entry_ec)))
        fail_write(shown / name, ENOTDIR);
      move_tree(from, to, shown, name, written);
    } else {
      if (::rename((from / name).c_str(), (to / name).c_str()) != 0)
        fail_write(shown / name, errno);
    }
    written.insert(name);
  }
  if (ec) fail_write(shown / rel, ec.value());
}

/// Removes the files of an earlier dump in `to` (the stage's names, dump_writes) that the new one
/// did not write: a smaller run leaves no stale tensors. Their fp8/ goes too once it is empty.
void remove_stale_dump_files(const fs::path& to, const fs::path& shown,
                             const std::set<fs::path>& written) {
  for (const fs::path& sub : {fs::path(), fs::path("fp8")}) {
    std::error_code ec;
    if (!fs::is_directory(fs::symlink_status(to / sub, ec))) continue;
    bool removed = false;
    for (fs::directory_iterator it(to / sub, ec), end; !ec && it != end; it.increment(ec)) {
      const fs::path name = sub / it->path().filename();
      std::error_code entry_ec;
      if (written.contains(name) || !dump_writes(name) ||
          !fs::is_regular_file(it->symlink_status(entry_ec)))
        continue;
      if (::unlink((to / name).c_str()) != 0) fail_write(shown / name, errno);
      removed = true;
    }
    if (removed && !sub.empty() && !written.contains(sub)) ::rmdir((to / sub).c_str());
  }
}

/// Moves the dump filled in `staging` into the existing directory `to` file by file, each in one
/// rename, then removes its stale files. Holds an exclusive lock (flock) on `to` meanwhile, so
/// that two runs' moves do not interleave: the last one's set is what stays. `shown` names `to`
/// in errors.
void move_dump_into(const fs::path& staging, const fs::path& to, const fs::path& shown) {
  int fd = -1;
  do fd = ::open(to.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) fail_write(shown, errno);
  const struct Closer {
    int fd;
    ~Closer() { ::close(fd); }  // releases the lock
  } closer{fd};
  // Where the file system has no locks (ENOLCK, EOPNOTSUPP) the moves go unlocked.
  while (::flock(fd, LOCK_EX) != 0 && errno == EINTR) {
  }
  std::set<fs::path> written;
  move_tree(staging, to, shown, {}, written);
  remove_stale_dump_files(to, shown, written);
}

/// Sets shown_as while it lives.
class ShownAsScope {
 public:
  explicit ShownAsScope(const ShownAs& alias) : outer_(std::exchange(shown_as, &alias)) {}
  ~ShownAsScope() { shown_as = outer_; }
  ShownAsScope(const ShownAsScope&) = delete;
  ShownAsScope& operator=(const ShownAsScope&) = delete;

 private:
  const ShownAs* outer_;
};

}  // namespace

std::string output_collision(const std::vector<NamedPath>& outputs,
                             const std::vector<NamedPath>& inputs) {
  const auto in_dump = [](const NamedPath& file, const NamedPath& dump) {
    return fmt::format("{} lies inside {} under a name the dump writes ('{}'): write it elsewhere",
                       quoted(file), quoted(dump), dump_file_at(file.path, dump.path).string());
  };
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const NamedPath& a = outputs[i];
    for (std::size_t j = 0; j < i; ++j) {
      const NamedPath& b = outputs[j];
      if (same_file(a.path, b.path))
        return fmt::format("{} is the same file as {}: each output needs its own", quoted(a),
                           quoted(b));
      if (b.directory && !dump_file_at(a.path, b.path).empty()) return in_dump(a, b);
      if (a.directory && !dump_file_at(b.path, a.path).empty()) return in_dump(b, a);
    }
    for (const NamedPath& in : inputs) {
      if (same_file(a.path, in.path))
        return fmt::format("{} would overwrite the input {}: write it elsewhere", quoted(a),
                           quoted(in));
      if (a.directory && !dump_file_at(in.path, a.path).empty())
        return fmt::format("the input {} lies inside {} under a name the dump writes ('{}')",
                           quoted(in), quoted(a), dump_file_at(in.path, a.path).string());
    }
  }
  return {};
}

void write_dump_dir(const fs::path& dir, const std::function<void(const fs::path&)>& fill) {
  const Target target = target_of(directory_name(dir));
  if (target.kind == Target::refused) fail_write(dir, target.why);
  if (target.kind != Target::missing && target.kind != Target::directory) fail_write(dir, ENOTDIR);
  const bool exists = target.kind == Target::directory;
  // A new directory's missing parents are made now, when the dump is written (prepare_dump_dir
  // made nothing).
  if (std::error_code made;
      !exists && !fs::create_directories(target.path.parent_path(), made) && made)
    fail_write(dir, made.value());
  // Staged inside an existing directory (only it need be writable), else beside the new one.
  const fs::path staging =
      create_temporary_dir(exists ? target.path / target.path.filename() : target.path);
  if (staging.empty()) fail_write(dir, errno);
  std::error_code ec;
  try {
    {
      const ShownAs alias{staging, dir};
      const ShownAsScope scope(alias);
      fill(staging);
    }
    // A new directory takes its name in one rename, never over one made meanwhile (which then
    // receives the files as an existing one does).
    if (!exists) {
      if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, target.path.c_str(), RENAME_NOREPLACE) ==
          0)
        return;
      if (errno != EEXIST && errno != ENOTEMPTY && errno != EINVAL) fail_write(dir, errno);
      if (::mkdir(target.path.c_str(), 0777) != 0 && errno != EEXIST) fail_write(dir, errno);
    }
    move_dump_into(staging, target.path, dir);
    fs::remove_all(staging, ec);
  } catch (...) {
    fs::remove_all(staging, ec);
    throw;
  }
}

}  // namespace tpx
