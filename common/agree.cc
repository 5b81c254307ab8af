#include "agree.h"

#include <mpi.h>

#include <cstdint>
#include <sstream>

#include <fmt/format.h>

#include "check.h"

namespace tpx {
namespace {

int world_rank() {
  int rank = 0;
  TPX_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  return rank;
}

int world_size() {
  int size = 1;
  TPX_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  return size;
}

/// `text` on every rank, as `root` has it.
std::string broadcast(std::string text, int root) {
  int len = static_cast<int>(text.size());
  TPX_MPI_CHECK(MPI_Bcast(&len, 1, MPI_INT, root, MPI_COMM_WORLD));
  text.resize(static_cast<std::size_t>(len));
  TPX_MPI_CHECK(MPI_Bcast(text.data(), len, MPI_CHAR, root, MPI_COMM_WORLD));
  return text;
}

/// Every rank's `text`, in rank order.
std::vector<std::string> all_gather(const std::string& text) {
  const int world = world_size();
  int len = static_cast<int>(text.size());
  std::vector<int> lens(static_cast<std::size_t>(world)), offsets(lens.size());
  TPX_MPI_CHECK(MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, MPI_COMM_WORLD));
  int total = 0;
  for (std::size_t r = 0; r < lens.size(); ++r) {
    offsets[r] = total;
    total += lens[r];
  }
  std::string all(static_cast<std::size_t>(total), '\0');
  TPX_MPI_CHECK(MPI_Allgatherv(text.data(), len, MPI_CHAR, all.data(), lens.data(), offsets.data(),
                               MPI_CHAR, MPI_COMM_WORLD));
  std::vector<std::string> out;
  for (std::size_t r = 0; r < lens.size(); ++r)
    out.push_back(
        all.substr(static_cast<std::size_t>(offsets[r]), static_cast<std::size_t>(lens[r])));
  return out;
}

/// FNV-1a, 64 bit: a cheap fingerprint of the serialised flags (a difference is then confirmed
/// and named by comparing the flags themselves).
std::uint64_t fingerprint(const std::string& text) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char ch : text) {
    h ^= ch;
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string serialise(const ConfigFields& fields) {
  std::string text;
  for (const auto& [name, value] : fields) text += fmt::format("{}={}\n", name, value);
  return text;
}

ConfigFields parse(const std::string& text) {
  ConfigFields fields;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const auto eq = line.find('=');
    fields.emplace_back(line.substr(0, eq), eq == std::string::npos ? "" : line.substr(eq + 1));
  }
  return fields;
}

}  // namespace

StartVerdict agree_to_start(bool stop, int exit_code, const std::string& message) {
  const int rank = world_rank(), world = world_size();
  // One all-reduce: the first stopping rank, and (-1 on a rank that runs) whether all stop.
  int mine[2] = {stop ? rank : world, stop ? 0 : -1}, lowest[2] = {world, 0};
  TPX_MPI_CHECK(MPI_Allreduce(mine, lowest, 2, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  const int first = lowest[0];
  if (first == world) return {};
  StartVerdict v{.stop = true, .exit_code = exit_code, .rank = first, .message = {}};
  TPX_MPI_CHECK(MPI_Bcast(&v.exit_code, 1, MPI_INT, first, MPI_COMM_WORLD));
  v.message = broadcast(rank == first ? message : std::string(), first);
  if (lowest[1] == 0) {  // every rank stops: the same words everywhere?
    int same = v.message == message ? 1 : 0, all_same = 0;
    TPX_MPI_CHECK(MPI_Allreduce(&same, &all_same, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
    v.unanimous = all_same == 1;
  }
  return v;
}

std::string config_disagreement(const ConfigFields& fields) {
  const std::string text = serialise(fields);
  // One all-reduce: the minimum of h and of ~h give the minimum and the maximum fingerprint.
  const std::uint64_t h = fingerprint(text);
  std::uint64_t mine[2] = {h, ~h}, lowest[2] = {0, 0};
  TPX_MPI_CHECK(MPI_Allreduce(mine, lowest, 2, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD));
  if (lowest[0] == ~lowest[1]) return {};

  const std::vector<std::string> all = all_gather(text);
  for (std::size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    const ConfigFields a = parse(all[0]), b = parse(all[r]);
    for (std::size_t i = 0; i < a.size() && i < b.size(); ++i)
      if (a[i] != b[i])
        return a[i].first != b[i].first
                   ? fmt::format("ranks 0 and {} run different builds ('{}' vs '{}')", r,
                                 a[i].first, b[i].first)
                   : fmt::format(
                         "the ranks disagree on {}: {} on rank 0, {} on rank {} (every rank must "
                         "be started with the same flags)",
                         a[i].first, a[i].second, b[i].second, r);
    return fmt::format("ranks 0 and {} run different builds ({} vs {} config fields)", r, a.size(),
                       b.size());
  }
  return {};  // a fingerprint collision cannot make equal texts differ; unreachable
}

}  // namespace tpx
