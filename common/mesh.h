// The device mesh: the job's ranks laid out as a grid whose dimensions are the kinds of
// parallelism, each rank one point of it and a member of one group per dimension. Stage 07's mesh
// is DP × TP; stage 08 puts context parallelism (CP, the sequence split) between them, and stage
// 09 adds pipeline parallelism (PP, the layers split) outermost, in TorchTitan's order (pp, dp,
// cp, tp) with TP innermost:
//
//   rank = ((pp_index · D + dp_index) · C + cp_index) · T + tp_index    (T = world / (P·D·C))
//
// so the T ranks of a TP group are consecutive, and land on one node when the launcher fills
// nodes in rank order: the all-gathers and reduce-scatters inside every layer stay on NVLink;
// the CP ring (once per layer, K and V) is next; only the DP group's once-per-layer traffic is
// outermost but for PP, whose point-to-point messages (one activation per micro-batch and stage
// boundary) are the least of all and may cross nodes. At P = D = C = 1 the TP group is the whole
// job: stages 02-06. At C = 1 the DP×CP group is the DP group: stage 07. Every group but the PP
// group lies inside one pipeline stage's P-th of the job (a "slice"), which runs as stage 08 does.
//
// defines: tpx::MeshGroup, tpx::MeshGiven, tpx::Mesh
#pragma once

#include <string>
#include <vector>

#include "comm/group.h"

namespace tpx {

/// This rank's group along one dimension of a mesh, for the placement check (common/placement.h).
struct MeshGroup {
  std::string dim;  ///< "tp", "cp", "dp", "pp"
  RankGroup group;
};

/// Which of a mesh's sizes the user gave by flag: a message names a given size by its flag
/// ("--dp 4") and one the stage chose by its letter and the flag it stands for ("C 2 (--cp's
/// default)"), so that it never blames a flag the user did not type.
struct MeshGiven {
  bool pp = true, dp = true, cp = true;
};

struct Mesh {
  int pp = 1, dp = 1, cp = 1, tp = 1;  ///< P, D, C and T, P·D·C·T = the job's ranks
  int pp_index = 0, dp_index = 0, cp_index = 0, tp_index = 0;  ///< this rank's coordinates
  RankGroup tp_group;     ///< the T ranks with this rank's dp_index and cp_index, in tp order
  RankGroup cp_group;     ///< the C ranks with this rank's dp_index and tp_index: the CP ring
  RankGroup dp_group;     ///< the D ranks with this rank's cp_index and tp_index, in dp order
  RankGroup dp_cp_group;  ///< the D·C ranks with this rank's tp_index, in (dp, cp) order
  /// The P ranks with this rank's dp_index, cp_index and tp_index, in pp order: the pipeline
  /// through which this rank's activations flow (a group of one when P = 1).
  RankGroup pp_group;

  int dp_cp() const { return dp * cp; }                         ///< D·C
  int dp_cp_index() const { return dp_index * cp + cp_index; }  ///< rank in dp_cp_group

  /// The job rank of this rank's pipeline neighbour `pp_index + step` (mod P): the next stage
  /// (+1) and the previous (−1) hold the same dp, cp and tp coordinates.
  int pp_peer(int step) const { return pp_group.world_rank_of(((pp_index + step) % pp + pp) % pp); }

  /// Splits the job into P × D × C × (world / (P·D·C)); collective over the job. Throws
  /// ConfigError (the same line on every rank, problem()'s) unless P·D·C divides the job's ranks.
  static Mesh make(int dp, int cp = 1, int pp = 1);
  /// Why P × D × C × TP cannot lay out `world` ranks, in one line naming the sizes as `given`
  /// says; empty when it can. Every size is at least 1 and the product P·D·C is checked, so sizes
  /// whose product leaves the int range are refused, never wrapped. Needs no communication.
  static std::string problem(int world, int dp, int cp, int pp, MeshGiven given = {});
  /// "D 2 × TP 2 (this rank: dp 1, tp 0)" for headers and messages ("D 1 × CP 2 × TP 2 (...)"
  /// when there is a CP dimension, "P 2 × D 1 × CP 1 × TP 2 (...)" with a PP one).
  std::string describe() const;
  /// This rank's group of every dimension, TP first (PP last, when P > 1).
  std::vector<MeshGroup> groups() const;
};

}  // namespace tpx
