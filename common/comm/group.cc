#include "group.h"

#include <utility>

#include <fmt/format.h>

#include "common/check.h"

namespace tpx {

struct RankGroup::State {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  std::string name;
  std::vector<int> world_ranks;  // world_ranks[r]: the job rank of group rank r

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (comm != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm);
  }

  void fill() {
    TPX_MPI_CHECK(MPI_Comm_rank(comm, &rank));
    TPX_MPI_CHECK(MPI_Comm_size(comm, &size));
    // Every rank of the group learns every member's job rank.
    int me = 0;
    TPX_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &me));
    world_ranks.resize(static_cast<std::size_t>(size));
    TPX_MPI_CHECK(MPI_Allgather(&me, 1, MPI_INT, world_ranks.data(), 1, MPI_INT, comm));
  }
};

RankGroup::RankGroup(std::shared_ptr<const State> s) : state_(std::move(s)) {}

// The whole job needs no state of its own (and no MPI call, so that options holding it can be
// made anywhere, before MPI starts): its numbers are MPI_COMM_WORLD's.
RankGroup::RankGroup() = default;

RankGroup RankGroup::split(int color, int key, std::string name) {
  TPX_CHECK(color >= 0, "a rank group's color must be non-negative (got {})", color);
  auto s = std::make_shared<State>();
  TPX_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, color, key, &s->comm));
  s->name = std::move(name);
  s->fill();
  return RankGroup(std::move(s));
}

int RankGroup::rank() const {
  if (state_) return state_->rank;
  int r = 0;
  TPX_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &r));
  return r;
}
int RankGroup::size() const {
  if (state_) return state_->size;
  int n = 1;
  TPX_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &n));
  return n;
}
bool RankGroup::is_world() const {
  return state_ == nullptr;
}
const std::string& RankGroup::name() const {
  static const std::string kWorld;
  return state_ ? state_->name : kWorld;
}
MPI_Comm RankGroup::comm() const {
  return state_ ? state_->comm : MPI_COMM_WORLD;
}

int RankGroup::world_rank_of(int r) const {
  TPX_CHECK(r >= 0 && r < size(), "rank {} is not in {} (size {})", r,
            is_world() ? std::string("the job") : name(), size());
  return state_ ? state_->world_ranks[static_cast<std::size_t>(r)] : r;
}

std::vector<int> RankGroup::job_ranks() const {
  return state_ ? state_->world_ranks : std::vector<int>{};
}

std::string RankGroup::describe_rank(int r) const {
  if (is_world()) return fmt::format("rank {}", r);
  return fmt::format("rank {} of {} (job rank {})", r, state_->name, world_rank_of(r));
}

}  // namespace tpx
