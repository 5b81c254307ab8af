#include "mesh.h"

#include <fmt/format.h>

#include "check.h"

namespace tpx {

Mesh Mesh::make(int dp, int cp) {
  const RankGroup world;
  const int n = world.size(), rank = world.rank();
  if (cp < 1 || n % cp != 0)
    throw ConfigError(fmt::format(
        "--cp {} must divide the {} ranks of the job (the mesh is D × C × TP, TP = ranks / (D·C))",
        cp, n));
  if (dp < 1 || n % (dp * cp) != 0)
    throw ConfigError(
        cp == 1 ? fmt::format("--dp {} must divide the {} ranks of the job (the mesh is D × TP, "
                              "TP = ranks / D)",
                              dp, n)
                : fmt::format("--dp {} × --cp {} must divide the {} ranks of the job (the mesh "
                              "is D × C × TP, TP = ranks / (D·C))",
                              dp, cp, n));
  Mesh m;
  m.dp = dp;
  m.cp = cp;
  m.tp = n / (dp * cp);
  m.tp_index = rank % m.tp;
  m.cp_index = rank / m.tp % cp;
  m.dp_index = rank / (m.tp * cp);
  const int dp_cp = m.dp_cp_index();
  // Every split is collective over the job: every rank makes all of them, in the same order.
  m.tp_group =
      m.tp == n ? RankGroup()
                : RankGroup::split(dp_cp, m.tp_index,
                                   cp == 1 ? fmt::format("tp group {}", m.dp_index)
                                           : fmt::format("tp group {}.{}", m.dp_index, m.cp_index));
  m.dp_group = RankGroup::split(m.cp_index * m.tp + m.tp_index, m.dp_index,
                                cp == 1 ? fmt::format("dp group {}", m.tp_index)
                                        : fmt::format("dp group {}.{}", m.cp_index, m.tp_index));
  if (cp == 1) {
    m.cp_group = RankGroup::split(rank, 0, fmt::format("cp group {}", rank));
    m.dp_cp_group = m.dp_group;
  } else {
    m.cp_group = RankGroup::split(m.dp_index * m.tp + m.tp_index, m.cp_index,
                                  fmt::format("cp group {}.{}", m.dp_index, m.tp_index));
    m.dp_cp_group = RankGroup::split(m.tp_index, dp_cp, fmt::format("dp×cp group {}", m.tp_index));
  }
  return m;
}

std::string Mesh::describe() const {
  if (cp == 1)
    return fmt::format("D {} × TP {} (this rank: dp {}, tp {})", dp, tp, dp_index, tp_index);
  return fmt::format("D {} × CP {} × TP {} (this rank: dp {}, cp {}, tp {})", dp, cp, tp, dp_index,
                     cp_index, tp_index);
}

std::vector<MeshGroup> Mesh::groups() const {
  if (cp == 1) return {{"tp", tp_group}, {"dp", dp_group}};
  return {{"tp", tp_group}, {"cp", cp_group}, {"dp", dp_group}};
}

}  // namespace tpx
