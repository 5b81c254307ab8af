// The communicator backends behind make_communicator() (internal to common/comm/).
//
// defines: tpx::make_mpi_communicator(), tpx::make_nccl_communicator(), tpx::local_gpu_identity()
#pragma once

#include <memory>
#include <string>

#include "communicator.h"

namespace tpx {

/// MPI over a duplicate of MPI_COMM_WORLD; cuda tensors are staged through host buffers.
/// `name` is what name() returns (it says why this backend was chosen).
std::unique_ptr<Communicator> make_mpi_communicator(const CommOptions& o, std::string name);

#if TPX_WITH_NCCL
/// NCCL on the current CUDA device (one GPU per rank), with its own stream.
std::unique_ptr<Communicator> make_nccl_communicator(const CommOptions& o);
/// "<host> <PCI bus id of the current CUDA device>": equal on two ranks iff they share a GPU.
std::string local_gpu_identity();
#endif

}  // namespace tpx
