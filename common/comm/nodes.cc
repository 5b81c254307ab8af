#include "nodes.h"

#include <mpi.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "common/check.h"

namespace tpx {
namespace {

/// What one rank tells the others (a fixed-size record, gathered as bytes).
struct Record {
  enum : int { unset, set, bad };
  int env = unset;
  int id = 0;      ///< TPX_NODE_ID when set
  int leader = 0;  ///< the smallest job rank of the group that shares memory with this rank
  char text[MPI_MAX_PROCESSOR_NAME] = {};  ///< the host name, or TPX_NODE_ID's text when bad
};

void copy_text(char (&dst)[MPI_MAX_PROCESSOR_NAME], std::string_view src) {
  const std::size_t n = std::min(src.size(), sizeof dst - 1);
  std::memcpy(dst, src.data(), n);
  dst[n] = '\0';
}

/// "0-3", "0,2", "0-1,4-5": ascending numbers with consecutive runs joined.
std::string ranges(const std::vector<int>& sorted) {
  std::string out;
  for (std::size_t i = 0; i < sorted.size();) {
    std::size_t j = i;
    while (j + 1 < sorted.size() && sorted[j + 1] == sorted[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += j == i ? fmt::format("{}", sorted[i]) : fmt::format("{}-{}", sorted[i], sorted[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace

NodeMap NodeMap::discover(const RankGroup& group) {
  int me = 0;
  TPX_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &me));
  Record mine;
  // The node as MPI sees it: the ranks of the group that can share memory with this one.
  MPI_Comm shared = MPI_COMM_NULL;
  TPX_MPI_CHECK(MPI_Comm_split_type(group.comm(), MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &shared));
  TPX_MPI_CHECK(MPI_Allreduce(&me, &mine.leader, 1, MPI_INT, MPI_MIN, shared));
  MPI_Comm_free(&shared);
  int len = 0;
  TPX_MPI_CHECK(MPI_Get_processor_name(mine.text, &len));
  // The test hook overrides it.
  if (const char* env = std::getenv(kNodeIdVariable); env != nullptr) {
    const std::string_view text(env);
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), mine.id);
    mine.env = ec == std::errc() && end == text.data() + text.size() && mine.id >= 0 ? Record::set
                                                                                     : Record::bad;
    if (mine.env == Record::bad) copy_text(mine.text, text);
  }

  std::vector<Record> all(static_cast<std::size_t>(group.size()));
  TPX_MPI_CHECK(MPI_Allgather(&mine, sizeof(Record), MPI_BYTE, all.data(), sizeof(Record), MPI_BYTE,
                              group.comm()));
  std::vector<Rank> ranks;
  bool from_env = false;
  for (int r = 0; r < group.size(); ++r) {
    const Record& x = all[static_cast<std::size_t>(r)];
    if (x.env == Record::bad)
      throw ConfigError(fmt::format(
          "{} must be an integer >= 0 naming the rank's node (a test hook; leave it unset on a "
          "real cluster), but {} has '{}'",
          kNodeIdVariable, group.describe_rank(r), x.text));
    from_env = from_env || x.env == Record::set;
    ranks.push_back(x.env == Record::set
                        ? Rank{group.world_rank_of(r), x.id, fmt::format("node {}", x.id)}
                        : Rank{group.world_rank_of(r), -1 - std::int64_t{x.leader}, x.text});
  }
  return NodeMap(std::move(ranks), from_env);
}

NodeMap::NodeMap(std::vector<Rank> ranks, bool from_env)
    : ranks_(std::move(ranks)), from_env_(from_env) {
  std::map<std::int64_t, int> node_of_key;
  for (const Rank& r : ranks_) {
    const auto [it, added] = node_of_key.try_emplace(r.node_key, nodes());
    if (added) names_.push_back(r.node_name);
    node_.push_back(it->second);
  }
}

std::string NodeMap::layout() const {
  std::vector<int> count(names_.size(), 0);
  for (int n : node_) ++count[static_cast<std::size_t>(n)];
  const auto [lo, hi] = std::ranges::minmax(count);
  const std::string per = lo == hi ? fmt::format("{}", lo) : fmt::format("{}–{}", lo, hi);
  return fmt::format("{} node{} × {} rank{} per node", nodes(), nodes() == 1 ? "" : "s", per,
                     hi == 1 ? "" : "s");
}

std::string NodeMap::where() const {
  std::string out;
  for (int n = 0; n < nodes(); ++n) {
    std::vector<int> job;
    for (std::size_t r = 0; r < ranks_.size(); ++r)
      if (node_[r] == n) job.push_back(ranks_[r].world_rank);
    std::ranges::sort(job);
    out +=
        fmt::format("{}{}: job rank{} {}", n == 0 ? "" : "; ", names_[static_cast<std::size_t>(n)],
                    job.size() == 1 ? "" : "s", ranges(job));
  }
  return out;
}

int NodeMap::ring_links_across() const {
  const int n = ranks();
  int across = 0;
  for (int r = 0; n > 1 && r < n; ++r) across += node_of(r) != node_of((r + 1) % n) ? 1 : 0;
  return across;
}

NodeMap NodeMap::of(const RankGroup& group) const {
  std::vector<Rank> members;
  for (int r = 0; r < group.size(); ++r) {
    const int w = group.world_rank_of(r);
    TPX_CHECK(w < ranks() && ranks_[static_cast<std::size_t>(w)].world_rank == w,
              "NodeMap::of needs the whole job's map (job rank {} is not rank {} of this one)", w,
              w);
    members.push_back(ranks_[static_cast<std::size_t>(w)]);
  }
  return NodeMap(std::move(members), from_env_);
}

}  // namespace tpx
