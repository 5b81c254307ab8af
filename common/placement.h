// Where a stage's rank groups land on the nodes, checked once at start-up. Every group of the
// mesh is held against the job's node map (common/comm/nodes.h):
//
//   a group that needs one node    symmetric memory (stages 05, 06, and 07's TP groups) refuses
//                                  a group spanning nodes itself: one line, exit 2, every rank
//   a TP group spanning nodes      legal but slow: TP moves activations inside every layer, so
//                                  rank 0 warns once, after step 0, with the TP bytes per step
//                                  that cross the network
//   DP (later CP, PP) groups       may span nodes freely: their traffic is once per layer or per
//                                  micro-batch, and is what the network is for
//
// defines: tpx::Placement, tpx::place()
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "comm/nodes.h"
#include "mesh.h"

namespace tpx {

struct Placement {
  /// The header's line: "2 nodes × 2 ranks per node (node ids from TPX_NODE_ID) | tp groups each
  /// on one node | dp groups span 2 nodes" (the groups only when the job spans nodes).
  std::string header;
  /// This rank's TP group and its nodes, when it spans nodes.
  std::optional<NodeMap> tp_nodes;
  std::string tp_name;  ///< "the tp group (the whole job)", "tp group 1"
  int job_nodes = 1;

  /// The one-line warning for a TP group that spans nodes, given one step's TP bus bytes per
  /// rank; "" when the TP group is on one node.
  std::string tp_warning(std::uint64_t tp_bus_bytes) const;
};

/// Holds every group of `groups` (this rank's, one per dimension, in the same order on every
/// rank) against the job's node map `job`. Collective over the job.
Placement place(const NodeMap& job, const std::vector<MeshGroup>& groups);

}  // namespace tpx
