// The device mesh: the job's ranks laid out as a grid whose dimensions are the kinds of
// parallelism, each rank one point of it and a member of one group per dimension. Stage 07's mesh
// is DP × TP, TorchTitan's and Megatron-LM's order with TP innermost:
//
//   rank = dp_index · T + tp_index        (T = world / D)
//
// so the T ranks of a TP group are consecutive, and land on one node when the launcher fills
// nodes in rank order: the all-gathers and reduce-scatters inside every layer stay on NVLink,
// and only the DP group's once-per-layer traffic crosses nodes. At D = 1 the TP group is the
// whole job and the DP group is each rank alone: stages 02-06.
//
// defines: tpx::MeshGroup, tpx::Mesh
#pragma once

#include <string>
#include <vector>

#include "comm/group.h"

namespace tpx {

/// This rank's group along one dimension of a mesh, for the placement check (common/placement.h).
struct MeshGroup {
  std::string dim;  ///< "tp", "dp"
  RankGroup group;
};

struct Mesh {
  int dp = 1, tp = 1;              ///< D and T, D·T = the job's ranks
  int dp_index = 0, tp_index = 0;  ///< this rank's coordinates
  RankGroup tp_group;              ///< the T ranks with this rank's dp_index, in tp order
  RankGroup dp_group;              ///< the D ranks with this rank's tp_index, in dp order

  /// Splits the job into D × (world / D); collective over the job. Throws ConfigError (the
  /// same line on every rank) unless D divides the job's ranks.
  static Mesh make(int dp);
  /// "D 2 × TP 2 (this rank: dp 1, tp 0)" for headers and messages.
  std::string describe() const;
  /// This rank's group of every dimension, TP first.
  std::vector<MeshGroup> groups() const;
};

}  // namespace tpx
