#include "common/checkpoint.h"

#include <fcntl.h>
#include <mpi.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <exception>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string_view>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "check.h"
#include "ops.h"
#include "output.h"

namespace tpx {

namespace {

// The table of the byte-at-a-time CRC: entry b is the remainder of b shifted through 8 steps.
constexpr std::array<std::uint32_t, 256> make_crc_table() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t r = b;
    for (int k = 0; k < 8; ++k) r = (r & 1U) ? (r >> 1) ^ 0xEDB88320U : r >> 1;
    table[b] = r;
  }
  return table;
}

constexpr std::array<std::uint32_t, 256> kCrcTable = make_crc_table();

}  // namespace

std::uint32_t crc32(const void* data, std::size_t n, std::uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t r = ~crc;
  for (std::size_t i = 0; i < n; ++i) r = kCrcTable[(r ^ p[i]) & 0xFFU] ^ (r >> 8);
  return ~r;
}

std::optional<std::vector<IndexRange>> overlap(const std::vector<IndexRange>& a,
                                               const std::vector<IndexRange>& b) {
  if (a.size() != b.size()) return std::nullopt;
  std::vector<IndexRange> box(a.size());
  for (std::size_t d = 0; d < a.size(); ++d) {
    const std::int64_t lo = std::max(a[d].start, b[d].start);
    const std::int64_t hi = std::min(a[d].start + a[d].length, b[d].start + b[d].length);
    if (hi <= lo) return std::nullopt;
    box[d] = {lo, hi - lo};
  }
  return box;
}

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr std::string_view kFormat = "tpx-checkpoint";

std::int64_t volume(const std::vector<IndexRange>& box) {
  std::int64_t n = 1;
  for (const IndexRange& r : box) n *= r.length;
  return n;
}

/// The box [0, n) per dim of a tensor of `shape` whose element 0 lies at global index `origin`.
std::vector<IndexRange> box_at(const std::vector<IndexRange>& origin,
                               const std::vector<std::int64_t>& shape) {
  std::vector<IndexRange> box(shape.size());
  for (std::size_t d = 0; d < shape.size(); ++d) box[d] = {origin[d].start, shape[d]};
  return box;
}

/// Copies the global indices `region` from a row-major array holding the global box `from`
/// (src[0] being that box's element `skip`) into one holding the global box `to`.
void copy_region(const float* src, const std::vector<IndexRange>& from, std::int64_t skip,
                 float* dst, const std::vector<IndexRange>& to,
                 const std::vector<IndexRange>& region) {
  const std::size_t dims = region.size();
  if (dims == 0 || volume(region) == 0) return;
  std::vector<std::int64_t> at(dims);  // the region's index being copied, per dim
  for (std::size_t d = 0; d < dims; ++d) at[d] = region[d].start;
  auto linear = [&](const std::vector<IndexRange>& box) {
    std::int64_t i = 0;
    for (std::size_t d = 0; d < dims; ++d) i = i * box[d].length + (at[d] - box[d].start);
    return i;
  };
  const std::int64_t run = region[dims - 1].length;
  while (true) {
    std::copy_n(src + (linear(from) - skip), run, dst + linear(to));
    std::size_t d = dims - 1;  // the next run: the odometer over every dim but the last
    while (d-- > 0) {
      if (++at[d] < region[d].start + region[d].length) break;
      at[d] = region[d].start;
    }
    if (d == std::size_t(-1)) return;
  }
}

json box_json(const std::vector<IndexRange>& box) {
  json j = json::array();
  for (const IndexRange& r : box) j.push_back({r.start, r.length});
  return j;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

/// The fields of the run the saved state depends on: the model's shapes, and what decides which
/// tensors there are (task, optimizer) and how they were trained (dtype recipe); and RoPE's θ and
/// the sequence length, which an export needs.
json model_json(const BlockConfig& c) {
  return {{"hidden", c.hidden},
          {"heads", c.heads},
          {"kv_heads", c.kv_heads_or_heads()},
          {"ffn", c.ffn},
          {"layers", c.layers},
          {"vocab", c.lm() ? json(c.vocab) : json(nullptr)},
          {"task", task_flag(c.task)},
          {"dtype", dtype_flag(c.dtype)},
          {"optimizer", optimizer_flag(c.optimizer)},
          // Not checked on resume (a run may go on at another θ or length), but what an export
          // to another framework's config needs (tools/tpx_hf.py).
          {"rope_theta", c.rope_theta},
          {"seq", c.seq}};
}

/// An index read back: its path (for messages), its directory and its JSON.
struct Index {
  fs::path dir, path;
  json j;
};

/// The index.json of the checkpoint directory `dir`, parsed, with its format checked (the
/// version, and that its fields have the types the reader uses): a sentence naming it otherwise.
std::optional<std::string> read_index(const fs::path& dir, Index& out) {
  out.dir = dir;
  out.path = dir / "index.json";
  std::ifstream in(out.path, std::ios::binary);
  if (!in) return fmt::format("'{}': cannot be read", out.path.string());
  std::stringstream text;
  text << in.rdbuf();
  try {
    out.j = json::parse(text.str());
    const json& j = out.j;
    if (!j.is_object() || j.value("format", "") != kFormat)
      return fmt::format("'{}': not a tpx checkpoint index (no \"format\": \"{}\")",
                         out.path.string(), kFormat);
    const int version = j.at("version").get<int>();
    if (version > kCheckpointVersion)
      return fmt::format(
          "'{}': format version {} is newer than this program reads ({}): resume it with the "
          "build that wrote it",
          out.path.string(), version, kCheckpointVersion);
    (void)j.at("step").get<std::int64_t>();
    (void)j.at("chunk_bytes").get<std::int64_t>();
    if (j.at("chunk_bytes").get<std::int64_t>() < 4 || j.at("chunk_bytes").get<std::int64_t>() % 4)
      return fmt::format("'{}': chunk_bytes must be a positive multiple of 4", out.path.string());
    for (const json& t : j.at("tensors")) {
      (void)t.at("name").get<std::string>();
      (void)t.at("shape").get<std::vector<std::int64_t>>();
      for (const json& sh : t.at("shards")) {
        (void)sh.at("file").get<std::string>();
        (void)sh.at("offset").get<std::int64_t>();
        (void)sh.at("box").get<std::vector<std::vector<std::int64_t>>>();
        (void)sh.at("crc32").get<std::vector<std::uint32_t>>();
      }
    }
  } catch (const json::exception& e) {
    return fmt::format("'{}': not a readable checkpoint index ({})", out.path.string(), e.what());
  }
  return std::nullopt;
}

std::vector<IndexRange> box_of(const json& shard) {
  std::vector<IndexRange> box;
  for (const auto& r : shard.at("box").get<std::vector<std::vector<std::int64_t>>>())
    box.push_back({r.size() > 0 ? r[0] : -1, r.size() > 1 ? r[1] : -1});
  return box;
}

/// step-<N>: N; nothing for any other name.
std::optional<std::int64_t> step_of(const std::string& name) {
  if (!name.starts_with("step-") || name.size() == 5 || name.size() > 5 + 18) return std::nullopt;
  std::int64_t n = 0;
  for (std::size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    n = n * 10 + (name[i] - '0');
  }
  return n;
}

/// Whether a file can be created in the existing directory `dir`.
bool writable_dir(const fs::path& dir) {
  std::error_code ec;
  return fs::is_directory(dir, ec) && ::access(dir.c_str(), W_OK | X_OK) == 0;
}

std::optional<std::string> save_dir_problem(const fs::path& dir) {
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    if (!fs::is_directory(dir, ec))
      return fmt::format("--save '{}': not a directory", dir.string());
    if (!writable_dir(dir))
      return fmt::format("--save '{}': no new files can be made in it", dir.string());
    return std::nullopt;
  }
  // A missing DIR is made at the first save, with its missing parents: the nearest existing
  // ancestor must take new directories.
  fs::path up = fs::absolute(dir, ec).parent_path();
  while (!up.empty() && !fs::exists(up, ec) && up != up.parent_path()) up = up.parent_path();
  if (!writable_dir(up))
    return fmt::format("--save '{}': cannot be made ('{}' takes no new directories)", dir.string(),
                       up.string());
  return std::nullopt;
}

/// --resume DIR resolved: DIR itself when it holds an index.json, else its step-<N> directory
/// with the largest N that does (a save that died before its index left none).
std::optional<std::string> find_checkpoint(const fs::path& dir, fs::path& found) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return fmt::format("--resume '{}': no such directory", dir.string());
  if (fs::is_regular_file(dir / "index.json", ec)) {
    found = dir;
    return std::nullopt;
  }
  std::optional<std::int64_t> best;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const auto n = step_of(it->path().filename().string());
    std::error_code e2;
    if (n && it->is_directory(e2) && fs::is_regular_file(it->path() / "index.json", e2) &&
        (!best || *n > *best)) {
      best = n;
      found = it->path();
    }
  }
  if (!best)
    return fmt::format(
        "--resume '{}': no checkpoint in it (no step-<N> directory holding an "
        "index.json)",
        dir.string());
  return std::nullopt;
}

/// The index's tensors against the run's (names and global shapes), its config against the
/// run's, and every shard's file, size, box and checksum count.
std::optional<std::string> check_index(const Index& index, const BlockConfig& c) {
  const json& j = index.j;
  const std::string where = fmt::format("'{}'", index.path.string());
  const json saved = j.value("model", json::object());
  const json mine = model_json(c);
  // What decides which tensors there are, and the recipe they were trained under.
  for (const char* key : {"task", "optimizer", "dtype"})
    if (saved.value(key, json()) != mine[key])
      return fmt::format("--resume {}: saved with --{} {}, this run has --{} {}", where, key,
                         saved.value(key, json()).dump(), key, mine[key].dump());
  // Every tensor of the run's model, with its global shape.
  std::map<std::string, const json*> by_name;
  for (const json& t : j.at("tensors")) by_name[t.at("name").get<std::string>()] = &t;
  const std::vector<StatePart> want = state_parts(c, Sharding{});
  for (const StatePart& p : want) {
    const auto it = by_name.find(p.name);
    if (it == by_name.end())
      return fmt::format(
          "--resume {}: has no tensor '{}' (this run has {} layers, the checkpoint "
          "{})",
          where, p.name, c.layers, saved.value("layers", json()).dump());
    const auto shape = it->second->at("shape").get<std::vector<std::int64_t>>();
    if (shape.size() != p.shape.size())
      return fmt::format("--resume {}: tensor '{}' is {} there, {} in this run", where, p.name,
                         shape_text(shape), shape_text(p.shape));
    for (std::size_t d = 0; d < shape.size(); ++d)
      if (shape[d] != p.shape[d])
        return fmt::format(
            "--resume {}: tensor '{}' is {} there, {} in this run (dim {}: {} vs {})", where,
            p.name, shape_text(shape), shape_text(p.shape), d, shape[d], p.shape[d]);
    if (it->second->value("dtype", "") != "f32")
      return fmt::format("--resume {}: tensor '{}' has dtype {}, not f32", where, p.name,
                         it->second->value("dtype", json()).dump());
  }
  if (by_name.size() != want.size())
    for (const auto& [name, t] : by_name)
      if (std::ranges::none_of(want, [&](const StatePart& p) { return p.name == name; }))
        return fmt::format(
            "--resume {}: tensor '{}' has no place in this run's model (the "
            "checkpoint has {} layers, this run {})",
            where, name, saved.value("layers", json()).dump(), c.layers);
  // How the data stream and the initialiser draw: from the seed and the step alone.
  const json data = j.value("data", json::object());
  if (data.value("seed", json()) != json(c.seed))
    return fmt::format(
        "--seed {}: the checkpoint {} was trained on seed {}, which draws its data (give --seed "
        "{})",
        c.seed, where, data.value("seed", json()).dump(), data.value("seed", json()).dump());
  if (c.lm() && data.value("source", json()) != json(c.data))
    return fmt::format("--data '{}': the checkpoint {} was trained on {}", c.data, where,
                       data.value("source", json()).dump());
  const auto step = j.at("step").get<std::int64_t>();
  if (c.steps <= step)
    return fmt::format(
        "--steps {}: the checkpoint {} is at step {} already (--steps counts from the start of "
        "training: give more than {})",
        c.steps, where, step, step);
  // Every shard: a plain file name in the directory, its bytes within the file, its box within
  // the tensor, one CRC per chunk; the boxes together as many elements as the tensor.
  const auto chunk = j.at("chunk_bytes").get<std::int64_t>();
  std::map<std::string, std::int64_t> sizes;
  for (const json& t : j.at("tensors")) {
    const auto name = t.at("name").get<std::string>();
    const auto shape = t.at("shape").get<std::vector<std::int64_t>>();
    std::int64_t covered = 0;
    for (const json& sh : t.at("shards")) {
      const auto file = sh.at("file").get<std::string>();
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
        return fmt::format(
            "--resume {}: tensor '{}' names the shard file '{}', not a file in "
            "its directory",
            where, name, file);
      const fs::path path = index.dir / file;
      if (!sizes.contains(file)) {
        std::error_code ec;
        const auto size = fs::file_size(path, ec);
        if (ec)
          return fmt::format("'{}': missing (tensor '{}' has a shard there)", path.string(), name);
        sizes[file] = std::int64_t(size);
      }
      const std::vector<IndexRange> box = box_of(sh);
      bool inside = box.size() == shape.size();
      for (std::size_t d = 0; inside && d < box.size(); ++d)
        inside = box[d].start >= 0 && box[d].length > 0 && box[d].start <= shape[d] &&
                 box[d].length <= shape[d] - box[d].start;
      if (!inside)
        return fmt::format("--resume {}: tensor '{}': a shard's box in '{}' lies outside {}", where,
                           name, file, shape_text(shape));
      const std::int64_t bytes = volume(box) * 4;
      const auto offset = sh.at("offset").get<std::int64_t>();
      if (offset < 0 || offset > sizes[file] - bytes)
        return fmt::format("'{}': {} bytes, but tensor '{}' ends at byte {} there (truncated)",
                           path.string(), sizes[file], name, offset + bytes);
      if (sh.at("crc32").size() != std::size_t((bytes + chunk - 1) / chunk))
        return fmt::format("--resume {}: tensor '{}': {} checksums for {} bytes in '{}'", where,
                           name, sh.at("crc32").size(), bytes, file);
      covered += volume(box);
    }
    std::int64_t numel = 1;
    for (const std::int64_t n : shape) numel *= n;
    if (covered != numel)
      return fmt::format("--resume {}: the shards of tensor '{}' hold {} of its {} elements", where,
                         name, covered, numel);
  }
  return std::nullopt;
}

/// Reads [at, at + n) of `path` into `out`, or a sentence naming the file.
std::optional<std::string> read_range(int fd, const fs::path& path, std::int64_t at, std::int64_t n,
                                      char* out) {
  while (n > 0) {
    const ssize_t got = ::pread(fd, out, std::size_t(n), off_t(at));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0)
      return fmt::format("'{}': cannot be read ({})", path.string(), std::strerror(errno));
    if (got == 0) return fmt::format("'{}': ends at byte {} (truncated)", path.string(), at);
    out += got;
    at += got;
    n -= got;
  }
  return std::nullopt;
}

/// Makes the entries of directory `dir` durable (fsync of the directory itself).
void sync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw Error(fmt::format("cannot write '{}': {}", dir.string(), std::strerror(errno)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw Error(fmt::format("cannot write '{}': {}", dir.string(), std::strerror(err)));
}

/// Every rank's `mine` on rank 0 (collective over `comm`); empty elsewhere.
std::vector<std::string> gather_text(const std::string& mine, int rank, int world, MPI_Comm comm) {
  const int len = static_cast<int>(mine.size());
  std::vector<int> lens(std::size_t(world), 0), at(std::size_t(world), 0);
  TPX_MPI_CHECK(MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, comm));
  std::string all;
  if (rank == 0) {
    for (int r = 1; r < world; ++r)
      at[std::size_t(r)] = at[std::size_t(r - 1)] + lens[std::size_t(r - 1)];
    all.resize(std::size_t(at.back() + lens.back()));
  }
  TPX_MPI_CHECK(MPI_Gatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), at.data(),
                            MPI_CHAR, 0, comm));
  std::vector<std::string> out;
  if (rank == 0)
    for (int r = 0; r < world; ++r)
      out.push_back(all.substr(std::size_t(at[std::size_t(r)]), std::size_t(lens[std::size_t(r)])));
  return out;
}

/// Stops every rank of `comm` with the lowest failing rank's error, a SaveError, when any rank
/// has one (collective).
void throw_if_any(const std::string& problem, MPI_Comm comm) {
  int rank = 0;
  TPX_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  const int mine = problem.empty() ? std::numeric_limits<int>::max() : rank;
  int first = 0;
  TPX_MPI_CHECK(MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm));
  if (first == std::numeric_limits<int>::max()) return;
  std::string text = problem;
  int len = static_cast<int>(text.size());
  TPX_MPI_CHECK(MPI_Bcast(&len, 1, MPI_INT, first, comm));
  text.resize(std::size_t(len));
  TPX_MPI_CHECK(MPI_Bcast(text.data(), len, MPI_CHAR, first, comm));
  throw SaveError(text);
}

}  // namespace

std::vector<StatePart> state_parts(const BlockConfig& c, const Sharding& s) {
  std::vector<StatePart> parts;
  // FSDP (stages 07-09): the D·C ranks of the DP×CP group each hold ⌈rows / (D·C)⌉ rows of a
  // TP-local tensor's dim 0, padded (07_fsdp_tp's FlatLayout), so the rank's tensor is
  // [⌈rows / (D·C)⌉, ...] and the part of the TP-local tensor it holds the rows [r0, r1), of
  // which only those the TP cut fills (`length`: the vocabulary's padding is not) are real.
  const std::int64_t group = std::int64_t(s.dp) * s.cp;
  // A tensor the TP group splits is every rank's to write; a replicated one rank 0's alone.
  auto add = [&](std::string name, std::vector<std::int64_t> shape, std::vector<std::int64_t> local,
                 std::vector<std::int64_t> at, std::vector<std::int64_t> length, bool split) {
    if (group > 1) {
      const std::int64_t rows = local[0], shard = (rows + group - 1) / group;
      const std::int64_t r0 = std::min(rows, s.dp_cp_index * shard);
      const std::int64_t r1 = std::min(length[0], r0 + shard);
      local[0] = shard;
      at[0] += std::min(r0, length[0]);
      length[0] = std::max<std::int64_t>(0, r1 - r0);
    }
    StatePart p;
    p.name = std::move(name);
    p.shape = std::move(shape);
    p.local = std::move(local);
    for (std::size_t d = 0; d < at.size(); ++d) p.box.push_back({at[d], length[d]});
    p.saved = volume(p.box) > 0 && ((s.weights && split) || s.rank == 0);
    parts.push_back(std::move(p));
  };
  // The layers the rank holds, in the order it holds them (a pipeline stage's, or all).
  std::vector<std::int64_t> layers = s.layers;
  if (layers.empty())
    for (std::int64_t l = 0; l < c.layers; ++l) layers.push_back(l);
  for (const std::int64_t l : layers)
    for (Param q : kAllParams) {
      const auto local = param_local_shape(q, c, s);
      add(fmt::format("layers.{}.{}", l, param_name(q)), param_shape(q, c), local,
          param_offset(q, c, s), local, param_split(q) != Split::replicated);
    }
  if (c.lm()) {
    // The vocabulary's cut: this rank's ids [begin, begin + real), its padding not saved.
    const VocabShard v = vocab_shard(c, s);
    const std::int64_t h = c.hidden, real = v.real(c.vocab);
    const std::int64_t at = std::min(v.begin, c.vocab);  // a range of padding alone: empty, at V
    if (s.embedding)
      add(std::string(kLmParamNames[0]), {c.vocab, h}, {v.local, h}, {at, 0}, {real, h}, true);
    if (s.head) {
      add(std::string(kLmParamNames[1]), {h}, {h}, {0}, {h}, false);
      add(std::string(kLmParamNames[2]), {h, c.vocab}, {h, v.local}, {0, at}, {h, real}, true);
    }
  }
  if (c.optimizer == Optimizer::adamw) {
    const std::size_t n = parts.size();
    for (const char* moment : {".adamw_m", ".adamw_v"})
      for (std::size_t i = 0; i < n; ++i) {
        StatePart p = parts[i];
        p.name += moment;
        parts.push_back(std::move(p));
      }
  }
  return parts;
}

std::int64_t checkpoint_file_bytes(const BlockConfig& c, const Sharding& s) {
  std::int64_t n = 0;  // no overflow: the memory estimate's checked sizes bound every part
  for (const StatePart& p : state_parts(c, s))
    if (p.saved) n += volume(p.box) * 4;
  return n;
}

std::optional<std::string> checkpoint_flag_problem(BlockConfig& c) {
  CheckpointOptions& k = c.checkpoint;
  if (k.save_every > 0 && k.save_dir.empty())
    return "--save-every needs --save DIR (where the checkpoints go)";
  if (!k.save_dir.empty())
    if (auto p = save_dir_problem(k.save_dir)) return p;
  if (k.resume_dir.empty()) return std::nullopt;
  fs::path dir;
  if (auto p = find_checkpoint(k.resume_dir, dir)) return p;
  Index index;
  if (auto p = read_index(dir, index)) return "--resume " + *p;
  if (auto p = check_index(index, c)) return p;
  k.resume_dir = dir.string();
  k.resume_step = index.j.at("step").get<std::int64_t>();
  return std::nullopt;
}

CheckpointSnapshot snapshot_state(const BlockConfig& c, const Sharding& s,
                                  const std::vector<const Tensor*>& state, std::int64_t step) {
  const std::vector<StatePart> parts = state_parts(c, s);
  TPX_CHECK(parts.size() == state.size(), "{} state tensors for {} parts", state.size(),
            parts.size());
  CheckpointSnapshot snap;
  snap.step = step;
  snap.dir = fs::path(c.checkpoint.save_dir) / fmt::format("step-{}", step);
  snap.packed.resize(parts.size());
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const StatePart& p = parts[i];
    if (!p.saved) continue;
    const Tensor host = ops::to_device(*state[i], Device::cpu);
    snap.packed[i].resize(std::size_t(volume(p.box)));
    copy_region(host.f32().data(), box_at(p.box, p.local), 0, snap.packed[i].data(), p.box, p.box);
  }
  return snap;
}

namespace {

/// --fault-full-disk-in-save: while it lives, the process's files cannot grow past half of
/// `snap`'s bytes (RLIMIT_FSIZE, SIGXFSZ ignored), so the shard's write() fails with EFBIG part
/// way, as on a disk that fills during the save, and the saver's own error path runs.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(const CheckpointSnapshot& snap) {
    rlim_t bytes = 0;
    for (const std::vector<float>& part : snap.packed) bytes += part.size() * sizeof(float);
    TPX_CHECK(::getrlimit(RLIMIT_FSIZE, &old_) == 0, "getrlimit: {}", std::strerror(errno));
    old_signal_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit low = old_;
    low.rlim_cur = bytes / 2;
    TPX_CHECK(::setrlimit(RLIMIT_FSIZE, &low) == 0, "setrlimit: {}", std::strerror(errno));
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, old_signal_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit old_{};
  void (*old_signal_)(int) = SIG_DFL;
};

/// Writes `snap` by the atomic protocol, collective over `comm` (every rank of the job).
void write_checkpoint(const BlockConfig& c, const Sharding& s, const CheckpointSnapshot& snap,
                      MPI_Comm comm) {
  const std::vector<StatePart> parts = state_parts(c, s);
  const std::int64_t step = snap.step;
  const fs::path dir = c.checkpoint.save_dir;
  const fs::path final_dir = dir / fmt::format("step-{}", step);
  const fs::path staging = dir / fmt::format("step-{}.tmp", step);
  // The job's ranks (a mesh's TP rank is not unique): one shard file each.
  int rank = 0, world = 1;
  TPX_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  TPX_MPI_CHECK(MPI_Comm_size(comm, &world));
  // Rank 0 makes an empty staging directory (what a save that died there left goes first).
  std::string problem;
  if (rank == 0) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (!ec) fs::remove_all(staging, ec);
    if (!ec) fs::create_directory(staging, ec);
    if (ec) problem = fmt::format("cannot write '{}': {}", staging.string(), ec.message());
  }
  throw_if_any(problem, comm);
  // Every rank its shard file: its parts packed one after another, a CRC per chunk of each.
  const std::string file = fmt::format("rank-{}.bin", rank);
  json shards = json::array();
  const bool full = rank == c.checkpoint.full_rank && step == c.checkpoint.full_step;
  std::optional<FileSizeLimit> disk_full;
  if (full) disk_full.emplace(snap);
  try {
    write_file_atomically(staging / file, [&](OutputFile& out) {
      std::int64_t offset = 0;
      for (std::size_t i = 0; i < parts.size(); ++i) {
        const StatePart& p = parts[i];
        if (!p.saved) continue;
        const std::vector<float>& packed = snap.packed[i];
        const std::int64_t bytes = std::int64_t(packed.size()) * 4;
        json crcs = json::array();
        const auto* b = reinterpret_cast<const char*>(packed.data());
        for (std::int64_t at = 0; at < bytes; at += kCheckpointChunkBytes)
          crcs.push_back(crc32(b + at, std::size_t(std::min(kCheckpointChunkBytes, bytes - at))));
        out.write(b, std::size_t(bytes));
        shards.push_back({{"tensor", p.name},
                          {"file", file},
                          {"offset", offset},
                          {"box", box_json(p.box)},
                          {"crc32", crcs}});
        offset += bytes;
      }
    });
  } catch (const Error& e) {
    problem = e.what();
  }
  disk_full.reset();
  throw_if_any(problem, comm);
  if (rank == c.checkpoint.kill_rank && step == c.checkpoint.kill_step) ::raise(SIGKILL);
  // After every shard: rank 0 writes the index, and the directory takes its name.
  const std::vector<std::string> all = gather_text(shards.dump(), rank, world, comm);
  if (rank == 0) {
    try {
      // Every tensor of the model, whichever ranks hold it (a pipeline stage holds some),
      // each with the shards the ranks wrote of it.
      json tensors = json::array();
      std::map<std::string, std::size_t> at;
      for (const StatePart& p : state_parts(c, Sharding{})) {
        at[p.name] = tensors.size();
        tensors.push_back(
            {{"name", p.name}, {"shape", p.shape}, {"dtype", "f32"}, {"shards", json::array()}});
      }
      for (const std::string& text : all)
        for (json& sh : json::parse(text)) {
          const std::size_t i = at.at(sh.at("tensor").get<std::string>());
          sh.erase("tensor");
          tensors[i]["shards"].push_back(std::move(sh));
        }
      const json index = {
          {"format", kFormat},
          {"version", kCheckpointVersion},
          {"step", step},
          {"model", model_json(c)},
          // The token stream and every draw are functions of (seed, step): the position to
          // go on from is the step, the RNG state the seed.
          {"data",
           {{"source", c.lm() ? json(c.data) : json(nullptr)},
            {"seed", c.seed},
            {"next_step", step}}},
          {"saved_by", {{"world_size", world}, {"tensor_parallel", s.weights}}},
          {"chunk_bytes", kCheckpointChunkBytes},
          {"tensors", tensors}};
      sync_dir(staging);
      write_text_file(staging / "index.json", index.dump(1) + '\n');
      // A checkpoint of this step saved earlier is replaced: moved aside, then removed.
      std::error_code ec;
      const fs::path old = dir / fmt::format("step-{}.old", step);
      if (fs::exists(final_dir, ec)) {
        fs::remove_all(old, ec);
        if (::rename(final_dir.c_str(), old.c_str()) != 0)
          throw Error(
              fmt::format("cannot write '{}': {}", final_dir.string(), std::strerror(errno)));
      }
      if (::rename(staging.c_str(), final_dir.c_str()) != 0)
        throw Error(fmt::format("cannot write '{}': {}", final_dir.string(), std::strerror(errno)));
      sync_dir(dir);
      fs::remove_all(old, ec);
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  throw_if_any(problem, comm);
}

}  // namespace

fs::path save_checkpoint(const BlockConfig& c, const Sharding& s,
                         const CheckpointSnapshot& snapshot) {
  write_checkpoint(c, s, snapshot, MPI_COMM_WORLD);
  return snapshot.dir;
}

struct AsyncCheckpointWriter::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  std::thread thread;
  std::exception_ptr error;  ///< what the save threw (null when it succeeded)
};

AsyncCheckpointWriter::AsyncCheckpointWriter() : impl_(std::make_unique<Impl>()) {
  int level = 0;
  TPX_MPI_CHECK(MPI_Query_thread(&level));
  if (level < MPI_THREAD_MULTIPLE)
    throw ConfigError(
        "--async-save needs MPI_THREAD_MULTIPLE (its writer thread communicates while the steps "
        "do), which this MPI does not provide");
  TPX_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &impl_->comm));
}

AsyncCheckpointWriter::~AsyncCheckpointWriter() {
  if (impl_->thread.joinable()) impl_->thread.join();
  MPI_Comm_free(&impl_->comm);
}

void AsyncCheckpointWriter::start(const BlockConfig& c, const Sharding& s,
                                  CheckpointSnapshot snapshot) {
  wait();
  impl_->thread = std::thread([this, c, s, snap = std::move(snapshot)] {
    try {
      write_checkpoint(c, s, snap, impl_->comm);
    } catch (...) {
      impl_->error = std::current_exception();
    }
  });
}

void AsyncCheckpointWriter::wait() {
  if (impl_->thread.joinable()) impl_->thread.join();
  if (impl_->error) std::rethrow_exception(std::exchange(impl_->error, nullptr));
}

std::string load_checkpoint(const BlockConfig& c, const Sharding& s,
                            const std::vector<Tensor*>& state) {
  const std::vector<StatePart> parts = state_parts(c, s);
  TPX_CHECK(parts.size() == state.size(), "{} state tensors for {} parts", state.size(),
            parts.size());
  Index index;
  if (auto p = read_index(c.checkpoint.resume_dir, index)) return *p;
  if (auto p = check_index(index, c)) return *p;
  std::map<std::string, const json*> by_name;
  for (const json& t : index.j.at("tensors")) by_name[t.at("name").get<std::string>()] = &t;
  const auto chunk = index.j.at("chunk_bytes").get<std::int64_t>();
  std::map<std::string, int> fds;
  struct Closer {
    std::map<std::string, int>& fds;
    ~Closer() {
      for (auto& [name, fd] : fds) ::close(fd);
    }
  } closer{fds};
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const StatePart& p = parts[i];
    const std::int64_t mine = volume(p.box);
    if (mine == 0) continue;  // all padding: stays zero
    const Tensor host = ops::to_device(*state[i], Device::cpu);
    const std::vector<IndexRange> local = box_at(p.box, p.local);
    std::int64_t filled = 0;
    for (const json& sh : by_name.at(p.name)->at("shards")) {
      const std::vector<IndexRange> box = box_of(sh);
      const auto shared = overlap(p.box, box);
      if (!shared) continue;
      // The shard's elements from the shared box's first to its last, in whole chunks.
      std::vector<std::int64_t> first, last;
      for (const IndexRange& r : *shared) {
        first.push_back(r.start);
        last.push_back(r.start + r.length - 1);
      }
      auto element = [&](const std::vector<std::int64_t>& g) {
        std::int64_t e = 0;
        for (std::size_t d = 0; d < g.size(); ++d) e = e * box[d].length + (g[d] - box[d].start);
        return e;
      };
      const std::int64_t bytes = volume(box) * 4;
      const std::int64_t c0 = element(first) * 4 / chunk, c1 = (element(last) * 4 + 3) / chunk;
      const std::int64_t begin = c0 * chunk, end = std::min((c1 + 1) * chunk, bytes);
      const auto name = sh.at("file").get<std::string>();
      const fs::path path = index.dir / name;
      if (!fds.contains(name)) {
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0)
          return fmt::format("'{}': cannot be read ({}; tensor '{}' has a shard there)",
                             path.string(), std::strerror(errno), p.name);
        fds[name] = fd;
      }
      std::vector<float> buf(std::size_t((end - begin) / 4));
      const auto offset = sh.at("offset").get<std::int64_t>();
      if (auto e = read_range(fds[name], path, offset + begin, end - begin,
                              reinterpret_cast<char*>(buf.data())))
        return *e + fmt::format(" (tensor '{}')", p.name);
      const auto crcs = sh.at("crc32").get<std::vector<std::uint32_t>>();
      for (std::int64_t k = c0; k <= c1; ++k) {
        const std::int64_t at = k * chunk - begin, n = std::min(chunk, bytes - k * chunk);
        if (crc32(reinterpret_cast<const char*>(buf.data()) + at, std::size_t(n)) !=
            crcs[std::size_t(k)])
          return fmt::format(
              "'{}': tensor '{}' fails its CRC-32 at bytes {}..{} of the file: the shard is "
              "corrupt",
              path.string(), p.name, offset + k * chunk, offset + k * chunk + n);
      }
      copy_region(buf.data(), box, begin / 4, host.f32().data(), local, *shared);
      filled += volume(*shared);
    }
    if (filled != mine)
      return fmt::format("'{}': the shards of tensor '{}' hold {} of this rank's {} elements",
                         index.path.string(), p.name, filled, mine);
    ops::copy(host, *state[i]);
  }
  return {};
}

}  // namespace tpx
