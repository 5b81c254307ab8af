// The device mesh: the job's ranks laid out as a grid whose dimensions are the kinds of
// parallelism, each rank one point of it and a member of one group per dimension. Stage 07's mesh
// is DP × TP; stage 08 puts context parallelism (CP, the sequence split) between them, in
// TorchTitan's and Megatron-LM's order with TP innermost:
//
//   rank = (dp_index · C + cp_index) · T + tp_index        (T = world / (D · C))
//
// so the T ranks of a TP group are consecutive, and land on one node when the launcher fills
// nodes in rank order: the all-gathers and reduce-scatters inside every layer stay on NVLink;
// the CP ring (once per layer, K and V) is next; only the DP group's once-per-layer traffic is
// outermost. At D = C = 1 the TP group is the whole job: stages 02-06. At C = 1 the DP×CP group
// is the DP group: stage 07.
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
  int dp = 1, cp = 1, tp = 1;                    ///< D, C and T, D·C·T = the job's ranks
  int dp_index = 0, cp_index = 0, tp_index = 0;  ///< this rank's coordinates
  RankGroup tp_group;     ///< the T ranks with this rank's dp_index and cp_index, in tp order
  RankGroup cp_group;     ///< the C ranks with this rank's dp_index and tp_index: the CP ring
  RankGroup dp_group;     ///< the D ranks with this rank's cp_index and tp_index, in dp order
  RankGroup dp_cp_group;  ///< the D·C ranks with this rank's tp_index, in (dp, cp) order

  int dp_cp() const { return dp * cp; }                         ///< D·C
  int dp_cp_index() const { return dp_index * cp + cp_index; }  ///< rank in dp_cp_group

  /// Splits the job into D × C × (world / (D·C)); collective over the job. Throws ConfigError
  /// (the same line on every rank) unless D·C divides the job's ranks.
  static Mesh make(int dp, int cp = 1);
  /// "D 2 × TP 2 (this rank: dp 1, tp 0)" for headers and messages ("D 1 × CP 2 × TP 2 (...)"
  /// when there is a CP dimension).
  std::string describe() const;
  /// This rank's group of every dimension, TP first.
  std::vector<MeshGroup> groups() const;
};

}  // namespace tpx
