// The CUDA device this process uses: lazy initialisation (device choice, allocator
// registration), the device's properties for launch configurations, and the stream ops are
// issued on.
//
// Device choice: the process's local rank (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID,
// SLURM_LOCALID, LOCAL_RANK) modulo the visible device count, else device 0; so `mpirun -np N`
// on one node spreads ranks over the node's GPUs and several ranks share a GPU when N exceeds
// the GPU count.
//
// defines: tpx::cuda::device_problem, ensure_initialized, DeviceInfo, device_info, device_name,
//          current_stream, set_current_stream, time_ms, StreamGuard, grid_for, synchronize,
//          memory_free_bytes, fp8_gemm_supported
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace tpx::cuda {

/// Empty when a CUDA device is usable; otherwise one line saying why not.
std::string device_problem();

/// Picks the device and registers the caching allocator for Device::cuda (once per process), and
/// binds the device to the calling thread (once per thread). Idempotent and cheap after the first
/// call; throws tpx::Error (naming the reason) when no device is usable.
void ensure_initialized();

/// What launch configurations are computed from.
struct DeviceInfo {
  int device = 0;
  std::string name;
  int sm_count = 0;
  int max_threads_per_sm = 0;
  int max_threads_per_block = 0;
  int warp_size = 32;
  int cc_major = 0, cc_minor = 0;
  std::size_t total_bytes = 0;
};

/// Properties of the device chosen by ensure_initialized() (which it calls).
const DeviceInfo& device_info();
/// e.g. "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 79.1 GiB)".
std::string device_name();
/// True when the device has FP8 tensor cores, which cuBLASLt's FP8 GEMMs (gemm_fp8.cc) need:
/// compute capability 8.9 (Ada) or newer (Hopper 9.0, Blackwell 10.x and 12.x). Initialises the
/// device like device_info(), so it throws tpx::Error where no GPU is usable.
bool fp8_gemm_supported();

/// The stream (a cudaStream_t) ops are issued on by the calling thread; nullptr, the legacy
/// default stream, unless a StreamGuard says otherwise.
void* current_stream();
void set_current_stream(void* stream);

/// ops::time_ms on cuda: milliseconds per call of `work` issued `reps` times between two events
/// on the current stream.
double time_ms(int reps, const std::function<void()>& work);

/// Issues the ops of a scope on another stream, restoring the previous one on exit.
class StreamGuard {
 public:
  explicit StreamGuard(void* stream) : previous_(current_stream()) { set_current_stream(stream); }
  ~StreamGuard() { set_current_stream(previous_); }
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  void* previous_;
};

/// Blocks for a grid-stride loop over `work` items with `threads` per block: enough blocks to
/// fill every SM at full occupancy, no more (more would only add scheduling overhead).
int grid_for(std::int64_t work, int threads);

/// Blocks the host until the current stream has drained.
void synchronize();

/// Free bytes of the chosen device (cudaMemGetInfo): what this process could still take from the
/// driver, shared with every other process on the GPU. Blocks cached by the caching allocator
/// count as taken.
std::size_t memory_free_bytes();

}  // namespace tpx::cuda
