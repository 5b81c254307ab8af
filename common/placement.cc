#include "placement.h"

#include <mpi.h>

#include <fmt/format.h>

#include "check.h"
#include "memory.h"

namespace tpx {

Placement place(const NodeMap& job, const std::vector<MeshGroup>& groups) {
  Placement p;
  p.job_nodes = job.nodes();
  p.header =
      job.layout() + (job.from_env() ? fmt::format(" (node ids from {})", kNodeIdVariable) : "");
  for (const MeshGroup& g : groups) {
    const NodeMap mine = job.of(g.group);
    // Rank 0 prints what every group of the dimension does: the fewest and most nodes one spans.
    int lo = mine.nodes(), hi = mine.nodes();
    TPX_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
    TPX_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
    if (g.group.size() > 1 && job.nodes() > 1) {
      const bool one = g.group.is_world();
      const std::string span = lo == hi ? fmt::format("{}", hi) : fmt::format("{}–{}", lo, hi);
      if (hi == 1)
        p.header += one ? fmt::format(" | the {} group on one node", g.dim)
                        : fmt::format(" | {} groups each on one node", g.dim);
      else
        p.header += one ? fmt::format(" | the {} group spans {} nodes", g.dim, span)
                        : fmt::format(" | {} groups span {} nodes", g.dim, span);
    }
    if (g.dim == "tp" && mine.nodes() > 1) {
      p.tp_nodes = mine;
      p.tp_name = g.group.is_world() ? "the tp group (the whole job)" : g.group.name();
    }
  }
  return p;
}

std::string Placement::tp_warning(std::uint64_t tp_bus_bytes) const {
  if (!tp_nodes) return {};
  const int links = tp_nodes->ring_links_across();
  return fmt::format(
      "{} spans {} nodes ({}): TP moves {} per rank every step (step 0's bus bytes), and {} of "
      "the {} links of a ring over its ranks cross between nodes, so about {} per step goes over "
      "the network; keep TP inside a node (stage 07 with --dp {} gives each node its own TP "
      "group)",
      tp_name, tp_nodes->nodes(), tp_nodes->where(), bytes_text(tp_bus_bytes), links,
      tp_nodes->ranks(), bytes_text(tp_bus_bytes * static_cast<std::uint64_t>(links)), job_nodes);
}

}  // namespace tpx
