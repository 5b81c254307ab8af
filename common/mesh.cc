#include "mesh.h"

#include <fmt/format.h>

#include "check.h"

namespace tpx {

Mesh Mesh::make(int dp) {
  const RankGroup world;
  const int n = world.size(), rank = world.rank();
  if (dp < 1 || n % dp != 0)
    throw ConfigError(fmt::format(
        "--dp {} must divide the {} ranks of the job (the mesh is D × TP, TP = ranks / D)", dp, n));
  Mesh m;
  m.dp = dp;
  m.tp = n / dp;
  m.dp_index = rank / m.tp;
  m.tp_index = rank % m.tp;
  // Both splits are collective over the job: every rank makes both, in the same order.
  m.tp_group =
      dp == 1 ? RankGroup()
              : RankGroup::split(m.dp_index, m.tp_index, fmt::format("tp group {}", m.dp_index));
  m.dp_group = RankGroup::split(m.tp_index, m.dp_index, fmt::format("dp group {}", m.tp_index));
  return m;
}

std::string Mesh::describe() const {
  return fmt::format("D {} × TP {} (this rank: dp {}, tp {})", dp, tp, dp_index, tp_index);
}

std::vector<MeshGroup> Mesh::groups() const {
  return {{"tp", tp_group}, {"dp", dp_group}};
}

}  // namespace tpx
