#include "output.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <regex>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "check.h"
#include "model.h"

namespace tpx {
namespace {

namespace fs = std::filesystem;

/// Thrown as it is: the message is the user's one line, with no source location.
[[noreturn]] void fail_write(const fs::path& path, int err) {
  throw Error(fmt::format("cannot write '{}': {}", path.string(), std::strerror(err)));
}

fs::path directory_of(const fs::path& path) {
  fs::path dir = path.parent_path();
  return dir.empty() ? fs::path(".") : dir;
}

/// A new, empty file next to `path`, named ".<name>.tmp-XXXXXX".
struct Temporary {
  int fd = -1;  ///< -1 on failure, with errno set
  fs::path path;
};

/// A new name next to `path`: ".<name>.<kind>-XXXXXX" with six random letters and digits.
fs::path sibling_name(const fs::path& path, std::string_view kind) {
  static constexpr std::string_view kChars =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 random(std::random_device{}());
  std::string suffix(6, ' ');
  for (char& c : suffix) c = kChars[random() % kChars.size()];
  return directory_of(path) / fmt::format(".{}.{}-{}", path.filename().string(), kind, suffix);
}

/// Creates the temporary with O_EXCL (never an existing file) and mode 0666, so that the umask
/// applies as to any new file (mkstemp's 0600 would make every output private).
Temporary create_temporary(const fs::path& path) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    fs::path temp = sibling_name(path, "tmp");
    const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0 || errno != EEXIST) return {fd, std::move(temp)};
  }
  return {};  // errno is EEXIST
}

/// A new, empty directory next to `path` (mode 0777 less the umask); empty path on failure, with
/// errno set.
fs::path create_temporary_dir(const fs::path& path) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    fs::path temp = sibling_name(path, "tmp");
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

bool under_dev_or_proc(const fs::path& path) {
  std::error_code ec;
  const fs::path abs = fs::absolute(path, ec).lexically_normal();
  auto it = abs.begin();
  if (ec || it == abs.end() || ++it == abs.end()) return false;
  return *it == "dev" || *it == "proc";
}

/// Where and how a path is written.
struct Target {
  fs::path path;  ///< the file a temporary replaces (a symlink's target), or the one written into
  bool in_place;  ///< true: written directly, it cannot be replaced by a rename
};

Target target_of(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {path, false};  // a new file
  if (!S_ISREG(st.st_mode) || under_dev_or_proc(path)) return {path, true};
  std::error_code ec;
  if (fs::is_symlink(path, ec)) {
    fs::path real = fs::canonical(path, ec);
    if (!ec) return {std::move(real), false};
  }
  return {path, false};
}

/// Whether a file named `name` matches `own`, or is a temporary of one that does.
bool is_ours(const std::string& name, const std::regex& own) {
  static const std::regex temporary(R"(\.(.+)\.tmp-[A-Za-z0-9]{6})");
  std::smatch m;
  if (std::regex_match(name, m, temporary)) return std::regex_match(m[1].str(), own);
  return std::regex_match(name, own);
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

/// Moves the entries of an old dump directory `from` that are not a stage's into the new one, `to`,
/// where no entry of that name exists. `top`: the directory itself, whose fp8/ is the stage's and
/// sorted alike; else its fp8/.
void carry_over(const fs::path& from, const fs::path& to, bool top) {
  std::error_code ec;
  for (fs::directory_iterator it(from, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code entry_ec;
    const bool directory = it->is_directory(entry_ec);
    if (top && directory && name == "fp8") {
      fs::create_directory(to / name, entry_ec);
      carry_over(it->path(), to / name, false);
      if (fs::is_empty(to / name, entry_ec)) fs::remove(to / name, entry_ec);
      continue;
    }
    if (!directory && is_ours(name, top ? stage_dump_files() : fp8_dump_files())) continue;
    if (!fs::exists(to / name, entry_ec)) fs::rename(it->path(), to / name, entry_ec);
  }
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
  if (target.in_place) {
    int fd = -1;
    do fd = ::open(path.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
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
  if (target.in_place) {
    if (fs::is_directory(path, ec)) return problem("is a directory");
    if (::access(path.c_str(), W_OK) != 0) return problem(std::strerror(errno));
    return {};
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
  std::error_code ec;
  const fs::path name = directory_name(dir);
  if (fs::exists(name, ec)) {
    if (!fs::is_directory(name, ec)) return problem("is not a directory");
    if (const int err = probe_directory_of(name / "config.json"); err != 0)
      return problem(fmt::format("cannot create files in it: {}", std::strerror(err)));
  }
  // The first name on the way down that does not exist yet (`name` itself, or a parent): the
  // dump creates it, so a directory must be creatable in its parent.
  fs::path first_missing = name;
  for (fs::path p = name; !p.empty() && p != p.parent_path(); p = p.parent_path()) {
    if (fs::exists(p, ec)) break;
    first_missing = p;
  }
  const fs::path beside = fs::exists(name, ec) ? name : first_missing;
  if (fs::exists(beside.parent_path(), ec) && !fs::is_directory(beside.parent_path(), ec))
    return problem(fmt::format("'{}' is not a directory", beside.parent_path().string()));
  const fs::path probe = create_temporary_dir(beside);
  if (probe.empty())
    return problem(fmt::format("cannot create a directory in '{}': {}",
                               beside.parent_path().string(), std::strerror(errno)));
  fs::remove(probe, ec);
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

/// Whether `p` lies inside the directory `dir` (resolved names).
bool inside(const fs::path& p, const fs::path& dir) {
  const fs::path rp = resolved(p), rd = resolved(dir);
  auto d = rd.begin();
  auto i = rp.begin();
  for (; d != rd.end(); ++d, ++i)
    if (i == rp.end() || *i != *d) return false;
  return i != rp.end();
}

std::string quoted(const NamedPath& n) {
  if (n.flag.empty()) return fmt::format("'{}'", n.path.string());
  return fmt::format("{} '{}'", n.flag, n.path.string());
}

}  // namespace

std::string output_collision(const std::vector<NamedPath>& outputs,
                             const std::vector<NamedPath>& inputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const NamedPath& a = outputs[i];
    for (std::size_t j = 0; j < i; ++j) {
      const NamedPath& b = outputs[j];
      if (same_file(a.path, b.path))
        return fmt::format("{} is the same file as {}: each output needs its own", quoted(a),
                           quoted(b));
      if (b.directory && inside(a.path, b.path))
        return fmt::format("{} lies inside {}, which the dump replaces whole: write it elsewhere",
                           quoted(a), quoted(b));
      if (a.directory && inside(b.path, a.path))
        return fmt::format("{} lies inside {}, which the dump replaces whole: write it elsewhere",
                           quoted(b), quoted(a));
    }
    for (const NamedPath& in : inputs) {
      if (same_file(a.path, in.path))
        return fmt::format("{} would overwrite the input {}: write it elsewhere", quoted(a),
                           quoted(in));
      if (a.directory && inside(in.path, a.path))
        return fmt::format("the input {} lies inside {}, which the dump replaces whole", quoted(in),
                           quoted(a));
    }
  }
  return {};
}

void write_dump_dir(const fs::path& dir, const std::function<void(const fs::path&)>& fill) {
  const fs::path target = directory_name(dir);
  // The directory's missing parents are made now, when the dump is written (prepare_dump_dir
  // made nothing).
  if (std::error_code made; !fs::create_directories(target.parent_path(), made) && made)
    fail_write(dir, made.value());
  const fs::path staging = create_temporary_dir(target);
  if (staging.empty()) fail_write(dir, errno);
  std::error_code ec;
  try {
    fill(staging);
  } catch (...) {
    fs::remove_all(staging, ec);
    throw;
  }
  // Into place: a rename onto a missing (or empty) directory, else an exchange with the old one.
  if (::rename(staging.c_str(), target.c_str()) == 0) return;
  if (errno != ENOTEMPTY && errno != EEXIST) {
    const int err = errno;
    fs::remove_all(staging, ec);
    fail_write(dir, err);
  }
  fs::path old = staging;  // after an exchange, the old directory is here
  if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0) {
    // A file system without exchange: the old directory steps aside first.
    old = sibling_name(target, "old");
    if (::rename(target.c_str(), old.c_str()) != 0 ||
        ::rename(staging.c_str(), target.c_str()) != 0) {
      const int err = errno;
      fs::remove_all(staging, ec);
      fail_write(dir, err);
    }
  }
  carry_over(old, target, /*top=*/true);
  fs::remove_all(old, ec);
}

}  // namespace tpx
