#include "05_copy_engine_async_tp/flags.h"

#include <CLI/CLI.hpp>

namespace tpx::async_tp {

const char* to_string(AllGatherPath p) {
  return p == AllGatherPath::pulls ? "pulls" : "nccl-zero-cta";
}

AllGatherPath AllGatherFlags::path() const {
  return word == "nccl-zero-cta" ? AllGatherPath::nccl_zero_cta : AllGatherPath::pulls;
}

void AllGatherFlags::add_flags(CLI::App& app, MeshFlag /*newest*/) {
  app.add_option("--all-gather", word,
                 "pulls (the hand-built copy-engine pulls from symmetric memory) or "
                 "nccl-zero-cta (NCCL >= 2.28's copy-engine all-gather on a registered "
                 "window; cuda, one GPU per rank)")
      ->check(CLI::IsMember({"pulls", "nccl-zero-cta"}))
      ->capture_default_str()
      ->group("Copy engine");
}

std::optional<std::string> AllGatherFlags::check(const CLI::App& /*app*/,
                                                 const StageOptions& o) const {
  if (path() == AllGatherPath::nccl_zero_cta && o.config.device == Device::cpu)
    return "--all-gather nccl-zero-cta cannot run on the cpu: NCCL's copy-engine all-gather moves "
           "GPU memory and needs --device cuda with one GPU per rank (on the cpu, the copy-engine "
           "path is the hand-built pulls: --all-gather pulls)";
  return std::nullopt;
}

ConfigFields AllGatherFlags::agreed() const {
  return {{"--all-gather", to_string(path())}};
}

}  // namespace tpx::async_tp
