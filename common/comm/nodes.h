// Which node (machine) each rank of a group runs on. A rank learns its node from MPI: the ranks
// that MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) puts together share memory, so they are one
// node; a node is named by its host name (MPI_Get_processor_name).
//
// The test hook: TPX_NODE_ID=<integer ≥ 0> in a rank's environment overrides its node identity
// (ranks with equal ids are one node, "node <id>"), so that one machine can play several nodes,
// e.g. `mpirun -np 2 -x TPX_NODE_ID=0 … : -np 2 -x TPX_NODE_ID=1 …`. Unset, it is ignored. It
// changes only what the placement checks believe; memory is still shared the way the machine
// shares it.
//
// defines: tpx::kNodeIdVariable, tpx::NodeMap
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "group.h"

namespace tpx {

/// The environment variable that overrides a rank's node identity (a test hook).
inline constexpr const char* kNodeIdVariable = "TPX_NODE_ID";

class NodeMap {
 public:
  /// One rank of the map: its job rank, the identity of its node, and the node's name.
  struct Rank {
    int world_rank = 0;
    std::int64_t node_key = 0;  ///< equal keys: one node
    std::string node_name;
  };

  /// Every rank of `group` learns the node of every other (collective over the group). Throws
  /// ConfigError, the same line on every rank, when some rank's TPX_NODE_ID is set but is not
  /// an integer ≥ 0.
  static NodeMap discover(const RankGroup& group = RankGroup());

  /// The map of `ranks` (in the group's rank order); nodes are numbered in order of their first
  /// rank. `from_env`: the identities came from TPX_NODE_ID.
  NodeMap(std::vector<Rank> ranks, bool from_env);

  int ranks() const { return static_cast<int>(ranks_.size()); }
  int nodes() const { return static_cast<int>(names_.size()); }
  /// The node (0 … nodes() − 1) of the map's rank `r`.
  int node_of(int r) const { return node_[static_cast<std::size_t>(r)]; }
  bool from_env() const { return from_env_; }

  /// "2 nodes × 2 ranks per node"; "2 nodes × 1–3 ranks per node" when the nodes differ.
  std::string layout() const;
  /// Where the ranks are, in job ranks: "job ranks 0-1 on node 0, 2-3 on node 1".
  std::string where() const;
  /// Of the n links r → r + 1 (mod n) of a ring over the ranks in order, those between two
  /// nodes (0 for a single rank).
  int ring_links_across() const;
  /// The same job's `group` as a map of its own (this map must be the whole job's: rank r of
  /// it is job rank r). Makes no MPI call.
  NodeMap of(const RankGroup& group) const;

 private:
  std::vector<Rank> ranks_;
  std::vector<int> node_;           // node_[r]: the node of rank r
  std::vector<std::string> names_;  // names_[node]
  bool from_env_ = false;
};

}  // namespace tpx
