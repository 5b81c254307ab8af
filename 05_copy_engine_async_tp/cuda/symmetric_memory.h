// The cuda backend of tpx::SymmetricMemory (../symmetric_memory.h): cudaMalloc'd buffer + pad
// per rank, CUDA IPC handles exchanged over MPI, pulls by cudaMemcpyAsync on the copy stream,
// signals by cuStreamWriteValue32 / cuStreamWaitValue32 on the pads.
//
// defines: tpx::cuda::make_symmetric_memory()
#pragma once

#include <cstddef>
#include <memory>

#include "05_copy_engine_async_tp/symmetric_memory.h"

namespace tpx::cuda {

/// Collective over MPI_COMM_WORLD (rank `rank` of `world`, all on one node). Throws ConfigError,
/// the same line on every rank, if some rank cannot map a peer's memory; then nothing stays
/// allocated or opened.
std::unique_ptr<SymmetricMemory> make_symmetric_memory(int rank, int world, std::size_t bytes,
                                                       const SymmetricOptions& o, Trace& trace);

}  // namespace tpx::cuda
