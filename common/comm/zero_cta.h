// The library path to compare stage 05's hand-built pulls against: NCCL's copy-engine ("zero-CTA")
// all-gather. From NCCL 2.28 a communicator created with the CTA policy NCCL_CTA_POLICY_ZERO runs
// an all-gather with the copy engines instead of a kernel (no CTA, so no SM, spent on moving
// bytes) when its buffers lie in a window registered on every rank with NCCL_WIN_COLL_SYMMETRIC
// (memory from ncclMemAlloc: NCCL maps it into the peers with the CUDA VMM API). Where NCCL cannot
// use the copy engines it falls back to a kernel without saying so; NCCL_DEBUG=INFO with
// NCCL_DEBUG_SUBSYS=TUNING logs "AllGather [Copy Engine]" when it did not.
//
// References: NCCL user guide, "NCCL API Supported Flags" (NCCL_CTA_POLICY_ZERO,
// NCCL_WIN_COLL_SYMMETRIC) and "Communicator Creation and Management Functions"
// (ncclCommInitRankConfig, ncclCommWindowRegister, ncclMemAlloc); NCCL 2.28 release notes.
//
// defines: tpx::ZeroCtaComm, tpx::make_zero_cta_comm()
#pragma once

#include <memory>

#include "common/tensor.h"
#include "communicator.h"

namespace tpx {

/// A NCCL communicator with the zero-CTA policy, and one buffer registered in it as a symmetric
/// window: an all-gather whose output is window() runs on the copy engines.
class ZeroCtaComm {
 public:
  virtual ~ZeroCtaComm() = default;
  /// The communicator (its own stream, flight recorder and watchdog, like every Communicator).
  virtual Communicator& comm() = 0;
  /// A [shape] tensor at the start of the window. When the window is too small it is replaced by
  /// a larger one, collectively: every rank must ask for the same sizes in the same order. The
  /// window is reused, so what one call returns is overwritten by the next all-gather into it.
  virtual Tensor window(const Tensor::Shape& shape, DType dtype) = 0;
};

/// Collective. Throws tpx::ConfigError, with the same one-line message on every rank, where the
/// zero-CTA all-gather cannot run: cpu tensors, a build without NCCL or with NCCL < 2.28, a
/// runtime NCCL < 2.28 on any rank, or ranks that share a GPU (NCCL needs one GPU per rank).
std::unique_ptr<ZeroCtaComm> make_zero_cta_comm(const CommOptions& o, Device device);

}  // namespace tpx
