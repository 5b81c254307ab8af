#include "mesh.h"

#include <fmt/format.h>

#include "check.h"

namespace tpx {

Mesh Mesh::make(int dp, int cp, int pp) {
  const RankGroup world;
  const int n = world.size(), rank = world.rank();
  if (pp < 1 || n % pp != 0)
    throw ConfigError(
        fmt::format("--pp {} must divide the {} ranks of the job (the mesh is P × D "
                    "× C × TP, TP = ranks / (P·D·C))",
                    pp, n));
  const int slice = n / pp;  // the ranks of one pipeline stage
  if (cp < 1 || slice % cp != 0)
    throw ConfigError(
        pp == 1 ? fmt::format("--cp {} must divide the {} ranks of the job (the mesh is D × C × "
                              "TP, TP = ranks / (D·C))",
                              cp, n)
                : fmt::format("--pp {} × --cp {} must divide the {} ranks of the job (the mesh is "
                              "P × D × C × TP, TP = ranks / (P·D·C))",
                              pp, cp, n));
  if (dp < 1 || slice % (dp * cp) != 0)
    throw ConfigError(
        pp > 1    ? fmt::format("--pp {} × --dp {} × --cp {} must divide the {} ranks of the job "
                                   "(the mesh is P × D × C × TP, TP = ranks / (P·D·C))",
                                pp, dp, cp, n)
        : cp == 1 ? fmt::format("--dp {} must divide the {} ranks of the job (the mesh is D × TP, "
                                "TP = ranks / D)",
                                dp, n)
                  : fmt::format("--dp {} × --cp {} must divide the {} ranks of the job (the mesh "
                                "is D × C × TP, TP = ranks / (D·C))",
                                dp, cp, n));
  Mesh m;
  m.pp = pp;
  m.dp = dp;
  m.cp = cp;
  m.tp = slice / (dp * cp);
  m.tp_index = rank % m.tp;
  m.cp_index = rank / m.tp % cp;
  m.dp_index = rank / (m.tp * cp) % dp;
  m.pp_index = rank / slice;
  const int dp_cp = m.dp_cp_index();
  // Group names: as stage 07's and 08's without a PP dimension; with one, each slice's groups
  // carry its stage ("tp group 0.1 of pp 1").
  auto named = [&](std::string name) {
    return pp == 1 ? name : fmt::format("{} of pp {}", name, m.pp_index);
  };
  const int slice_base = m.pp_index * (dp * cp);  // keeps every slice's colours apart
  // Every split is collective over the job: every rank makes all of them, in the same order.
  m.tp_group = m.tp == n
                   ? RankGroup()
                   : RankGroup::split(
                         slice_base + dp_cp, m.tp_index,
                         named(cp == 1 ? fmt::format("tp group {}", m.dp_index)
                                       : fmt::format("tp group {}.{}", m.dp_index, m.cp_index)));
  const int pp_tp = m.pp_index * m.tp + m.tp_index;
  m.dp_group =
      RankGroup::split((m.pp_index * cp + m.cp_index) * m.tp + m.tp_index, m.dp_index,
                       named(cp == 1 ? fmt::format("dp group {}", m.tp_index)
                                     : fmt::format("dp group {}.{}", m.cp_index, m.tp_index)));
  if (cp == 1) {
    m.cp_group = RankGroup::split(rank, 0, fmt::format("cp group {}", rank));
    m.dp_cp_group = m.dp_group;
  } else {
    m.cp_group = RankGroup::split((m.pp_index * dp + m.dp_index) * m.tp + m.tp_index, m.cp_index,
                                  named(fmt::format("cp group {}.{}", m.dp_index, m.tp_index)));
    m.dp_cp_group =
        RankGroup::split(pp_tp, dp_cp, named(fmt::format("dp×cp group {}", m.tp_index)));
  }
  if (pp > 1)
    m.pp_group =
        RankGroup::split(rank % slice, m.pp_index,
                         fmt::format("pp group {}.{}.{}", m.dp_index, m.cp_index, m.tp_index));
  else
    m.pp_group = RankGroup::split(rank, 0, fmt::format("pp group {}", rank));
  return m;
}

std::string Mesh::describe() const {
  if (pp > 1)
    return fmt::format("P {} × D {} × CP {} × TP {} (this rank: pp {}, dp {}, cp {}, tp {})", pp,
                       dp, cp, tp, pp_index, dp_index, cp_index, tp_index);
  if (cp == 1)
    return fmt::format("D {} × TP {} (this rank: dp {}, tp {})", dp, tp, dp_index, tp_index);
  return fmt::format("D {} × CP {} × TP {} (this rank: dp {}, cp {}, tp {})", dp, cp, tp, dp_index,
                     cp_index, tp_index);
}

std::vector<MeshGroup> Mesh::groups() const {
  std::vector<MeshGroup> g{{"tp", tp_group}};
  if (cp > 1) g.push_back({"cp", cp_group});
  g.push_back({"dp", dp_group});
  if (pp > 1) g.push_back({"pp", pp_group});
  return g;
}

}  // namespace tpx
