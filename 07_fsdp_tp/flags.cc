#include "07_fsdp_tp/flags.h"

#include <fmt/format.h>

#include "common/cli_flags.h"

namespace tpx::fsdp {

void DataParallelFlags::add_flags(CLI::App& app, MeshFlag newest) {
  add_mesh_degree(app, "--dp", dp, "D",
                  "data-parallel degree D: the ranks form a D × TP mesh (TP = ranks / D, TP "
                  "innermost); weights, gradients and optimizer state are sharded over D",
                  MeshFlag::dp, newest, "Mesh");
}

ConfigFields DataParallelFlags::agreed() const {
  return {{"--dp", fmt::format("{}", dp)}};
}

int default_dp(int dp, int world) {
  return mesh_degree(dp, MeshFlag::dp, MeshFlag::dp, world);
}

}  // namespace tpx::fsdp
