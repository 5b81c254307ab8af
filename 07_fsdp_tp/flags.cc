#include "07_fsdp_tp/flags.h"

#include <fmt/format.h>

#include "common/cli_flags.h"

namespace tpx::fsdp {

void DataParallelFlags::add_flags(CLI::App& app, MeshFlag newest) {
  add_number(app, "--dp", dp,
             "data-parallel degree D: the ranks form a D × TP mesh (TP = ranks / D, TP "
             "innermost); weights, gradients and optimizer state are sharded over D; "
             "when not given, " +
                 mesh_default_words(newest, MeshFlag::dp))
      ->type_name("D")
      ->group("Mesh");
}

ConfigFields DataParallelFlags::agreed() const {
  return {{"--dp", fmt::format("{}", dp)}};
}

int default_dp(int dp, int world) {
  return dp != 0 ? dp : mesh_default(MeshFlag::dp, MeshFlag::dp, world);
}

}  // namespace tpx::fsdp
