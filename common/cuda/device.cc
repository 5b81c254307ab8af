#include "device.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <mutex>
#include <string_view>

#include <fmt/format.h>

#include "allocator.h"
#include "check.h"

namespace tpx::cuda {
namespace {

/// The node-local rank from the launcher's environment, or -1.
int local_rank() {
  for (const char* var :
       {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"}) {
    if (const char* v = std::getenv(var)) {
      int r = -1;
      const std::string_view s(v);
      if (std::from_chars(s.data(), s.data() + s.size(), r).ec == std::errc{} && r >= 0) return r;
    }
  }
  return -1;
}

DeviceInfo& info_storage() {
  static DeviceInfo info;
  return info;
}

std::once_flag& init_flag() {
  static std::once_flag flag;
  return flag;
}

thread_local void* tls_stream = nullptr;

void initialize() {
  if (const auto why = device_problem(); !why.empty()) fail(why);
  int count = 0;
  TPX_CUDA_CHECK(cudaGetDeviceCount(&count));
  const int rank = local_rank();
  const int dev = rank >= 0 ? rank % count : 0;
  TPX_CUDA_CHECK(cudaSetDevice(dev));
  cudaDeviceProp p{};
  TPX_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  DeviceInfo& info = info_storage();
  info.device = dev;
  info.name = p.name;
  info.sm_count = p.multiProcessorCount;
  info.max_threads_per_sm = p.maxThreadsPerMultiProcessor;
  info.max_threads_per_block = p.maxThreadsPerBlock;
  info.warp_size = p.warpSize;
  info.cc_major = p.major;
  info.cc_minor = p.minor;
  info.total_bytes = p.totalGlobalMem;
  // Lives for the whole process: tensors may be released during static destruction.
  static auto* allocator = new CachingAllocator;
  register_allocator(Device::cuda, allocator);
}

}  // namespace

std::string device_problem() {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    return fmt::format("--device cuda: no CUDA device is visible (cudaGetDeviceCount: {})",
                       cudaGetErrorString(rc));
  }
  if (count == 0) return "--device cuda: no CUDA device is visible (cudaGetDeviceCount returned 0)";
  return {};
}

void ensure_initialized() {
  std::call_once(init_flag(), initialize);
  // cudaSetDevice binds only the calling host thread. Any other thread (the comm watchdog polling
  // events, a thread's own cuBLAS handles) would run on device 0 and create a context there, so
  // each thread binds the chosen device on its first call.
  thread_local const bool bound = [] {
    TPX_CUDA_CHECK(cudaSetDevice(info_storage().device));
    return true;
  }();
  (void)bound;
}

const DeviceInfo& device_info() {
  ensure_initialized();
  return info_storage();
}

std::string device_name() {
  const DeviceInfo& d = device_info();
  return fmt::format("{} (sm_{}{}, {} SMs, {:.1f} GiB)", d.name, d.cc_major, d.cc_minor, d.sm_count,
                     double(d.total_bytes) / double(1 << 30));
}

bool fp8_gemm_supported() {
  const DeviceInfo& d = device_info();
  return d.cc_major * 10 + d.cc_minor >= 89;
}

void* current_stream() {
  return tls_stream;
}
void set_current_stream(void* stream) {
  tls_stream = stream;
}

int grid_for(std::int64_t work, int threads) {
  const DeviceInfo& d = device_info();
  const std::int64_t needed = std::max<std::int64_t>(1, (work + threads - 1) / threads);
  const std::int64_t full = std::int64_t{d.sm_count} * std::max(1, d.max_threads_per_sm / threads);
  return static_cast<int>(std::min(needed, full));
}

void synchronize() {
  TPX_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(current_stream())));
}

double time_ms(int reps, const std::function<void()>& work) {
  auto stream = static_cast<cudaStream_t>(current_stream());
  cudaEvent_t start = nullptr, stop = nullptr;
  TPX_CUDA_CHECK(cudaEventCreate(&start));
  TPX_CUDA_CHECK(cudaEventCreate(&stop));
  TPX_CUDA_CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < reps; ++i) work();
  TPX_CUDA_CHECK(cudaEventRecord(stop, stream));
  TPX_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  TPX_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  TPX_CUDA_CHECK(cudaEventDestroy(start));
  TPX_CUDA_CHECK(cudaEventDestroy(stop));
  return double(ms) / reps;
}

std::size_t memory_free_bytes() {
  ensure_initialized();
  std::size_t free = 0, total = 0;
  TPX_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return free;
}

}  // namespace tpx::cuda
