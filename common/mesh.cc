#include "mesh.h"

#include <algorithm>
#include <cstdint>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "check.h"
#include "checked.h"

namespace tpx {

std::string Mesh::problem(int world, int dp, int cp, int pp, MeshGiven given) {
  struct Size {
    const char *flag, *letter;
    int value;
    bool given;
  };
  // In the order the mesh nests them (P outermost), which is also the order of the message.
  const Size sizes[] = {
      {"--pp", "P", pp, given.pp}, {"--dp", "D", dp, given.dp}, {"--cp", "C", cp, given.cp}};
  auto named = [](const Size& s) {
    return s.given ? fmt::format("{} {}", s.flag, s.value)
                   : fmt::format("{} {} ({}'s default)", s.letter, s.value, s.flag);
  };
  // P first, then C, then D: the first product that does not divide the ranks is the one to
  // name, with the sizes before it that are not 1.
  std::int64_t product = 1;
  std::vector<const Size*> checked;
  for (const Size* s : {&sizes[0], &sizes[2], &sizes[1]}) {
    checked.push_back(s);
    const auto next = checked_mul<std::int64_t>(product, s->value);
    // A product beyond the int range is beyond the ranks: it does not divide them either.
    if (s->value >= 1 && next && world % *next == 0) {
      product = *next;
      continue;
    }
    std::vector<std::string> names;
    for (const Size& size : sizes)
      if (std::ranges::find(checked, &size) != checked.end() && (&size == s || size.value != 1))
        names.push_back(named(size));
    const bool p = pp != 1, c = cp != 1;
    return fmt::format("{} must divide the {} ranks of the job (the mesh is {})",
                       fmt::join(names, " × "), world,
                       p   ? "P × D × C × TP, TP = ranks / (P·D·C)"
                       : c ? "D × C × TP, TP = ranks / (D·C)"
                           : "D × TP, TP = ranks / D");
  }
  return {};
}

Mesh Mesh::make(int dp, int cp, int pp) {
  const RankGroup world;
  const int n = world.size(), rank = world.rank();
  if (std::string p = problem(n, dp, cp, pp); !p.empty()) throw ConfigError(p);
  const int slice = n / pp;  // the ranks of one pipeline stage
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
