// Stage 07's part of the memory estimate: FSDP's unsharded layers, the term of the D·C ranks of the
// DP×CP group that share each parameter (stages 07, 08 and 09 run it), the language model's ends
// as FSDP gathers them, and on the cpu backend the MPI reduce-scatter's staging on the group's
// first rank. Its sharded parameters, gradients and optimizer state (the ends' too) are the shared
// terms at Sharding::dp and Sharding::cp (common/memory.cc).
//
// defines: tpx::fsdp::memory_dimension(), tpx::fsdp::unsharded_layers()
#pragma once

#include <memory>

#include "common/memory_terms.h"

namespace tpx::fsdp {

/// The FSDP dimension of the estimate (terms only where D·C > 1), for Sharding::dimensions.
/// `first_of_group`: this rank is rank 0 of its DP×CP group (Mesh::dp_cp_index() == 0), where
/// the cpu backend's MPI reduce-scatter stages the whole input ("MPI reduce-scatter staging").
/// `fp8_gather` (--fp8-weight-gather): the gathered and unsharded weights are E4M3 codes, a byte
/// per element (the two norm gains, 2H of a layer's elements, counted at a byte too).
std::shared_ptr<const MemoryDimension> memory_dimension(bool first_of_group = false,
                                                        bool fp8_gather = false);

/// The estimate's "unsharded layers (FSDP)" term for a layer of `layer` elements (its TP-local
/// count and this rank's kept shard): the unsharded copy and its gradients, the gathers and
/// reduce-scatters in flight around it (memory.cc says which). Stage 10 asks it for a layer
/// without the SwiGLU.
memory::Count unsharded_layers(const BlockConfig& c, const Sharding& s,
                               const memory::LayerElements& layer, memory::Count temporaries,
                               bool fp8_gather);

}  // namespace tpx::fsdp
