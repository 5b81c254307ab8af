// Error check for NCCL calls, kept apart from check.h so that only code that already includes
// <nccl.h> (and links NCCL) sees it. A failure throws tpx::Error naming the call, NCCL's error
// string and its last error message, file, line, host and rank.
//
// defines: tpx::cuda::fail_nccl, TPX_NCCL_CHECK
#pragma once

#include <nccl.h>

#include <source_location>
#include <string_view>

#include <fmt/format.h>

#include "common/check.h"

namespace tpx::cuda {

/// Throws tpx::Error for an ncclResult_t `code` returned by `call`.
[[noreturn]] inline void fail_nccl(ncclResult_t code, std::string_view call,
                                   std::source_location loc = std::source_location::current()) {
  const char* last = ncclGetLastError(nullptr);
  ::tpx::fail(fmt::format("{} failed: {} ({}){}{}", call, ncclGetErrorString(code),
                          static_cast<int>(code), (last && *last) ? ": " : "", last ? last : ""),
              loc);
}

}  // namespace tpx::cuda

/// Wraps an NCCL call (anything returning ncclResult_t). ncclInProgress is not an error for
/// non-blocking communicators, so it passes.
#define TPX_NCCL_CHECK(call)                                           \
  do {                                                                 \
    const ncclResult_t tpx_nccl_rc_ = (call);                          \
    if (tpx_nccl_rc_ != ncclSuccess && tpx_nccl_rc_ != ncclInProgress) \
      ::tpx::cuda::fail_nccl(tpx_nccl_rc_, #call);                     \
  } while (0)
