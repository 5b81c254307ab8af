#include "08_context_parallel/flags.h"

#include <fmt/format.h>

#include "common/cli_flags.h"

namespace tpx::cp {

CpMethod ContextParallelFlags::method() const {
  return method_of(method_word);
}

void ContextParallelFlags::add_flags(CLI::App& app, MeshFlag newest) {
  add_mesh_degree(app, "--cp", cp, "C",
                  "context-parallel degree C: the sequence is cut into 2C chunks, CP rank i "
                  "holding chunks i and 2C-1-i (mesh D × C × TP, TP innermost)",
                  MeshFlag::cp, newest, "Mesh");
  app.add_option("--cp-method", method_word,
                 "ring (K/V blocks around the CP ring, merged by log-sum-exp), allgather (K and "
                 "V all-gathered over CP) or ulysses (all-to-all to whole-sequence, "
                 "head-sharded q, k, v; needs NKV % (C·T) == 0)")
      ->check(CLI::IsMember({"ring", "allgather", "ulysses"}))
      ->capture_default_str()
      ->group("Mesh");
}

ConfigFields ContextParallelFlags::agreed() const {
  return {{"--cp", fmt::format("{}", cp)}, {"--cp-method", to_string(method())}};
}

}  // namespace tpx::cp
