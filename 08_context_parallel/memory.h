// Stage 08's part of the memory estimate: the CP attention buffers of its method (stages 08 and 09
// run it). The rank's S / C tokens are the shared terms' cut at Sharding::cp (common/memory.cc).
//
// defines: tpx::cp::memory_dimension()
#pragma once

#include <memory>

#include "08_context_parallel/traffic.h"
#include "common/memory_terms.h"

namespace tpx::cp {

/// The CP dimension of the estimate under `method` (a term only where C > 1), for
/// Sharding::dimensions.
std::shared_ptr<const MemoryDimension> memory_dimension(CpMethod method);

}  // namespace tpx::cp
