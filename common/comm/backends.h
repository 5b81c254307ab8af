// The communicator backends behind make_communicator() (internal to common/comm/).
//
// defines: tpx::make_mpi_communicator(), tpx::make_nccl_communicator(), tpx::local_gpu_identity(),
//          tpx::nccl_version(), tpx::make_nccl_zero_cta_comm()
#pragma once

#include <memory>
#include <string>

#include "communicator.h"
#include "zero_cta.h"

namespace tpx {

/// MPI over a duplicate of MPI_COMM_WORLD; cuda tensors are staged through host buffers.
/// `name` is what name() returns (it says why this backend was chosen).
std::unique_ptr<Communicator> make_mpi_communicator(const CommOptions& o, std::string name);

#if TPX_WITH_NCCL
/// NCCL on the current CUDA device (one GPU per rank), with its own stream.
std::unique_ptr<Communicator> make_nccl_communicator(const CommOptions& o);
/// "<host> <PCI bus id of the current CUDA device>": equal on two ranks iff they share a GPU.
std::string local_gpu_identity();
/// The NCCL this process runs with: NCCL_VERSION_CODE-style (2.28.9 is 22809); `built` is the one
/// its headers declared at build time instead.
int nccl_version(bool built = false);
/// make_zero_cta_comm() once the checks passed (NCCL >= 2.28 built and running, one GPU per rank).
std::unique_ptr<ZeroCtaComm> make_nccl_zero_cta_comm(const CommOptions& o);
#endif

}  // namespace tpx
