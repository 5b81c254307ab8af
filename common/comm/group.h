// A set of ranks that communicate together: the whole job, or one group of a device mesh (the
// TP group, the DP group of stage 07; later the CP and PP groups). Communicators, their
// watchdogs and symmetric memory are made over a group; every rank of the group must take part.
//
// defines: tpx::RankGroup
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

namespace tpx {

class RankGroup {
 public:
  /// Every rank of the job (MPI_COMM_WORLD), unnamed. Makes no MPI call.
  RankGroup();
  /// This rank's group when the job's ranks are split by `color` (equal colors form one group),
  /// ordered by `key` within it: MPI_Comm_split, collective over the whole job. `name` is what
  /// messages call the group, e.g. "tp group 1".
  static RankGroup split(int color, int key, std::string name);

  int rank() const;  ///< this rank's number in the group
  int size() const;  ///< how many ranks the group has
  bool is_world() const;
  /// "" for the whole job, else the name given to split().
  const std::string& name() const;
  /// The job rank (MPI_COMM_WORLD) of the group's rank `r`.
  int world_rank_of(int r) const;
  /// The job ranks of the group's members in group order, or none for the whole job: how a
  /// flight recorder's group lists its members.
  std::vector<int> job_ranks() const;
  /// "rank r" for the whole job; "rank r of <name> (job rank w)" for a group: how messages name a
  /// rank of this group.
  std::string describe_rank(int r) const;
  /// The group's MPI communicator (owned by the group; MPI_Comm_dup it to keep traffic apart).
  MPI_Comm comm() const;

 private:
  struct State;
  explicit RankGroup(std::shared_ptr<const State> s);
  std::shared_ptr<const State> state_;  // null for the whole job
};

}  // namespace tpx
