// Stage 10's part of the memory estimate: the experts (their parameters, gradients and AdamW
// moments on this rank, and what a MoE layer keeps for its backward under balanced routing), in
// place of the dense SwiGLU a MoE layer does not have.
//
// defines: tpx::ep::memory_dimension()
#pragma once

#include <memory>

#include "common/memory_terms.h"

namespace tpx::ep {

/// The experts' dimension of the estimate, for Sharding::dimensions (after FSDP's): EP ranks in
/// an EP group and the rank's index in the data-parallel group (its place in token order, which
/// the capacity's drops depend on).
std::shared_ptr<const MemoryDimension> memory_dimension(int ep, int dp_index);

}  // namespace tpx::ep
