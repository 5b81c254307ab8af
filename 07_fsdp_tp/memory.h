// Stage 07's part of the memory estimate: FSDP's unsharded layers, the term of the D·C ranks of the
// DP×CP group that share each parameter (stages 07, 08 and 09 run it). Its sharded parameters,
// gradients and optimizer state are the shared terms at Sharding::dp (common/memory.cc).
//
// defines: tpx::fsdp::memory_dimension()
#pragma once

#include <memory>

#include "common/memory_terms.h"

namespace tpx::fsdp {

/// The FSDP dimension of the estimate (a term only where D·C > 1), for Sharding::dimensions.
std::shared_ptr<const MemoryDimension> memory_dimension();

}  // namespace tpx::fsdp
