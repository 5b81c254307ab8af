// NVTX ranges (the "tpx" domain) so that an Nsight Systems timeline reads like the code: every
// CUDA op and every trainer phase (through tpx::TraceScope) opens one. Ranges cost a function
// call when no profiler is attached.
//
// defines: tpx::cuda::nvtx_push, tpx::cuda::nvtx_pop, tpx::cuda::NvtxRange
#pragma once

namespace tpx::cuda {

void nvtx_push(const char* name);
void nvtx_pop();

/// Opens a range for the enclosing scope.
class NvtxRange {
 public:
  explicit NvtxRange(const char* name) { nvtx_push(name); }
  ~NvtxRange() { nvtx_pop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace tpx::cuda
