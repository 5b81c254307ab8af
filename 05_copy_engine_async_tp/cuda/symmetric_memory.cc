// The cuda backend of tpx::SymmetricMemory (see ../symmetric_memory.h for the contract).
//
// Every rank cudaMalloc's one block: its buffer (rounded up to whole pad lines) followed by its
// signal pad, zeroed so that every counter starts at generation 0. The block's CUDA IPC handle is
// exchanged over MPI and every peer opens it, so each process holds a device pointer to every
// rank's block (this works between processes on one GPU, and between GPUs that can map each
// other's memory).
//
//   pull     cudaMemcpyAsync device to device from the peer's buffer, on the caller's stream:
//            the copy engine moves the bytes, no kernel runs.
//   signal   cuStreamWriteValue32 of the generation into the peer's pad. Its default flags put a
//            memory fence before the write ("similar semantics to __threadfence_system() but
//            scoped to the stream", CUDA driver API, CUstreamWriteValue_flags), so the writes the
//            stream made before it are visible to whoever sees the new value: release ordering.
//   wait     cuStreamWaitValue32 with CU_STREAM_WAIT_VALUE_GEQ on this rank's own pad: work issued
//            after it does not start before the counter has reached the generation.
//
// Generations are 64-bit on the host; the device counters hold their low 32 bits. The GEQ test is
// cyclic, "(int32_t)(*addr - value) >= 0" (CUDA driver API, CUstreamWaitValue_flags), so it stays
// right across the wrap at 2^32 as long as a counter is never 2^31 generations ahead of a wait,
// which the ready/done protocol rules out by far.
//
// The two stream memory operations are driver API calls. They are looked up through the runtime
// (cudaGetDriverEntryPointByVersion) rather than linked from libcuda, so that the library and
// every executable built on it still load on a machine without a CUDA driver, where the cpu
// backend runs.
//
// Signals and waits are marked done in the flight recorder when an event recorded right after
// them completes (finish_when(), polled by the watchdog thread), so a wait that never completes
// stays in flight and the watchdog reports it after the timeout. The trace spans of pulls cover
// the host's issue of the copy only (the device timeline is Nsight's).
//
// Setup failures (allocation, export, stream memory operations, a peer's GPU that this rank's GPU
// cannot map, a handle that does not open) are agreed on by all ranks: each throws the same
// ConfigError line, the first reason in rank order, after releasing what it had opened and
// allocated.
//
// defines: tpx::cuda::make_symmetric_memory() (CudaSymmetricMemory, internal)
#include "05_copy_engine_async_tp/cuda/symmetric_memory.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <source_location>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "common/cuda/check.h"
#include "common/cuda/device.h"

namespace tpx::cuda {
namespace {

/// The driver ABI version the entry points are requested for (CUDA 12.0: the v2 stream memory
/// operations, which every CUDA 12 and 13 driver supports without a module option).
constexpr unsigned int kDriverApiVersion = 12000;

/// Bytes of a setup failure's reason as the ranks exchange it (one line, truncated to fit).
constexpr std::size_t kReasonBytes = 256;
/// Bytes of a PCI bus id string ("0000:00:00.0" and a terminating zero fit easily).
constexpr std::size_t kBusIdBytes = 64;

/// The runtime's error string for `rc`; clears a non-sticky error so the process can go on.
std::string runtime_error_string(cudaError_t rc) {
  (void)cudaGetLastError();
  return fmt::format("{} ({})", cudaGetErrorString(rc), cudaGetErrorName(rc));
}

/// The driver API entry points this backend uses, looked up through the runtime.
class DriverApi {
 public:
  /// Empty when every entry point was found; otherwise one line saying which was not, and why.
  std::string load() {
    for (const std::string& why :
         {lookup("cuStreamWriteValue32", write_value32_),
          lookup("cuStreamWaitValue32", wait_value32_), lookup("cuGetErrorString", error_string_),
          lookup("cuGetErrorName", error_name_)})
      if (!why.empty()) return why;
    return {};
  }

  CUresult write_value32(CUstream s, CUdeviceptr addr, cuuint32_t value, unsigned flags) const {
    return write_value32_(s, addr, value, flags);
  }
  CUresult wait_value32(CUstream s, CUdeviceptr addr, cuuint32_t value, unsigned flags) const {
    return wait_value32_(s, addr, value, flags);
  }

  /// The driver's words for `rc`, e.g. "operation not supported (CUDA_ERROR_NOT_SUPPORTED 801)".
  std::string describe(CUresult rc) const {
    const char* text = nullptr;
    const char* name = nullptr;
    if (error_string_ == nullptr || error_string_(rc, &text) != CUDA_SUCCESS || text == nullptr)
      text = "unknown error";
    if (error_name_ == nullptr || error_name_(rc, &name) != CUDA_SUCCESS || name == nullptr)
      name = "CUresult";
    return fmt::format("{} ({} {})", text, name, static_cast<int>(rc));
  }

  /// Throws tpx::Error naming `call` unless `rc` is CUDA_SUCCESS.
  void check(CUresult rc, std::string_view call,
             std::source_location loc = std::source_location::current()) const {
    if (rc != CUDA_SUCCESS) fail(fmt::format("{} failed: {}", call, describe(rc)), loc);
  }

 private:
  template <class Fn>
  static std::string lookup(const char* symbol, Fn& fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t rc =
        cudaGetDriverEntryPointByVersion(symbol, &p, kDriverApiVersion, cudaEnableDefault, &found);
    if (rc != cudaSuccess)
      return fmt::format("cudaGetDriverEntryPointByVersion({}): {}", symbol,
                         runtime_error_string(rc));
    if (found != cudaDriverEntryPointSuccess || p == nullptr)
      return fmt::format("the CUDA driver has no {} for CUDA {}.{}", symbol,
                         kDriverApiVersion / 1000, kDriverApiVersion % 1000 / 10);
    fn = reinterpret_cast<Fn>(p);
    return {};
  }

  PFN_cuStreamWriteValue32_v11070 write_value32_ = nullptr;
  PFN_cuStreamWaitValue32_v11070 wait_value32_ = nullptr;
  PFN_cuGetErrorString_v6000 error_string_ = nullptr;
  PFN_cuGetErrorName_v6000 error_name_ = nullptr;
};

/// The zero-terminated string in `p[0, n)` (all n bytes if there is no zero).
std::string c_string(const char* p, std::size_t n) {
  return std::string(p, static_cast<std::size_t>(std::find(p, p + n, '\0') - p));
}

CUdeviceptr device_ptr(const std::byte* p) {
  return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
}

/// Prints a cleanup failure that a destructor cannot throw.
void warn(std::string_view what, cudaError_t rc) {
  fmt::print(stderr, "tpx: symmetric memory [{}]: warning: {} failed: {}\n", where_am_i(), what,
             runtime_error_string(rc));
  std::fflush(stderr);
}

class CudaSymmetricMemory final : public SymmetricMemory {
 public:
  CudaSymmetricMemory(int rank, int world, std::size_t bytes, const SymmetricOptions& o,
                      Trace& trace)
      : SymmetricMemory(rank, world, Device::cuda, bytes, o, trace),
        stride_((bytes + kPadLine - 1) / kPadLine * kPadLine),
        peers_(static_cast<std::size_t>(world), nullptr) {
    ensure_initialized();  // this process's device, bound to this thread (idempotent)
    const std::size_t block = stride_ + pad_bytes(world);

    // 1. This rank on its own: device, driver entry points, the zeroed block, its IPC handle, and
    //    one stream memory operation of each kind on its own pad.
    std::string why;
    char bus[kBusIdBytes] = {};
    cudaIpcMemHandle_t handle{};
    if (const cudaError_t rc = cudaGetDevice(&device_); rc != cudaSuccess)
      why = fmt::format("symmetric memory: rank {} has no current CUDA device (cudaGetDevice: {})",
                        rank, runtime_error_string(rc));
    if (why.empty())
      if (const cudaError_t rc = cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof bus), device_);
          rc != cudaSuccess)
        why =
            fmt::format("symmetric memory: rank {} cannot name its GPU (cudaDeviceGetPCIBusId: {})",
                        rank, runtime_error_string(rc));
    if (why.empty())
      if (const std::string missing = driver_.load(); !missing.empty())
        why = fmt::format("symmetric memory: rank {} cannot use stream memory operations ({})",
                          rank, missing);
    if (why.empty()) why = allocate(block, handle);
    if (why.empty()) why = probe_stream_memory_ops();
    agree(why);

    // 2. Every rank's GPU and handle; open every peer's block.
    std::vector<char> buses(static_cast<std::size_t>(world) * kBusIdBytes);
    TPX_MPI_CHECK(MPI_Allgather(bus, static_cast<int>(kBusIdBytes), MPI_CHAR, buses.data(),
                                static_cast<int>(kBusIdBytes), MPI_CHAR, options_.group.comm()));
    std::vector<cudaIpcMemHandle_t> handles(static_cast<std::size_t>(world));
    TPX_MPI_CHECK(MPI_Allgather(&handle, static_cast<int>(sizeof handle), MPI_BYTE, handles.data(),
                                static_cast<int>(sizeof handle), MPI_BYTE, options_.group.comm()));
    for (int p = 0; p < world && why.empty(); ++p) {
      if (p == rank) continue;
      const char* peer_bus = buses.data() + static_cast<std::size_t>(p) * kBusIdBytes;
      why = check_peer_device(p, c_string(peer_bus, kBusIdBytes), c_string(bus, kBusIdBytes));
      if (why.empty()) why = open(p, handles[static_cast<std::size_t>(p)]);
    }
    agree(why);

    start_watchdog();
  }

  ~CudaSymmetricMemory() override {
    stop();
    // Normally every rank gets here: once this rank's device work is done and every rank has
    // passed the barrier, no peer reads or signals into this rank's block any more. While an
    // exception unwinds on this rank the others may never arrive, so there is no barrier then;
    // the handles are closed and the block freed all the same.
    if (std::uncaught_exceptions() == 0) {
      if (const cudaError_t rc = cudaDeviceSynchronize(); rc != cudaSuccess)
        warn("cudaDeviceSynchronize", rc);
      MPI_Barrier(options_.group.comm());
    }
    release();
  }

  std::string name() const override {
    return fmt::format("cuda IPC over {} ranks (copy engine pulls, stream-ordered signals)",
                       world());
  }

 protected:
  std::byte* peer_base(int peer) const override {
    return peer == rank() ? own_ : peers_[static_cast<std::size_t>(peer)];
  }

  void do_pull(int peer, std::size_t offset, const Tensor& dst, const Stream& s,
               const std::string& what, int /*delay_us*/) override {
    // The random delay is a cpu test device (it jitters the copy thread); it is not used here.
    TraceScope span(trace_, what, Lane::copy);
    record_stream(dst, s);  // dst may come from another stream's pool; s now uses it
    TPX_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), peer_base(peer) + offset, dst.nbytes(),
                                   cudaMemcpyDeviceToDevice, native(s)));
  }

  void do_signal(int peer, Signal sig, std::uint64_t generation, const Stream& s, std::uint64_t seq,
                 int /*delay_us*/) override {
    recorder_.started(seq);
    // Default flags: a memory fence before the write, scoped to the stream (release ordering).
    driver_.check(
        driver_.write_value32(static_cast<CUstream>(s.native()), counter(peer, sig, rank()),
                              static_cast<cuuint32_t>(generation), CU_STREAM_WRITE_VALUE_DEFAULT),
        "cuStreamWriteValue32");
    mark_done_after(seq, s);
  }

  void do_wait(int peer, Signal sig, std::uint64_t generation, const Stream& s,
               std::uint64_t seq) override {
    // The low 32 bits of the generation against the counter, cyclically (see the top).
    driver_.check(
        driver_.wait_value32(static_cast<CUstream>(s.native()), counter(rank(), sig, peer),
                             static_cast<cuuint32_t>(generation), CU_STREAM_WAIT_VALUE_GEQ),
        "cuStreamWaitValue32");
    recorder_.started(seq);
    mark_done_after(seq, s);
  }

  void do_barrier() override {
    TPX_CUDA_CHECK(cudaDeviceSynchronize());
    TPX_MPI_CHECK(MPI_Barrier(options_.group.comm()));
  }

 private:
  static cudaStream_t native(const Stream& s) { return static_cast<cudaStream_t>(s.native()); }

  /// Device address of counter[sig][from] in `owner`'s pad.
  CUdeviceptr counter(int owner, Signal sig, int from) const {
    return device_ptr(peer_base(owner) + stride_ + pad_offset(sig, from, world()));
  }

  /// The flight recorder marks op `seq` done once `s` has passed the work issued on it so far.
  void mark_done_after(std::uint64_t seq, const Stream& s) {
    Event e(Device::cuda);
    e.record(s);
    finish_when(seq, std::move(e));
  }

  /// Allocates and zeroes this rank's block and exports it; empty on success, else the reason.
  std::string allocate(std::size_t block, cudaIpcMemHandle_t& handle) {
    void* p = nullptr;
    if (const cudaError_t rc = cudaMalloc(&p, block); rc != cudaSuccess)
      return fmt::format(
          "symmetric memory: rank {} cannot allocate {} B on its GPU (cudaMalloc: {})", rank(),
          block, runtime_error_string(rc));
    own_ = static_cast<std::byte*>(p);
    // All counters start at generation 0; the device is idle before any peer can see the block.
    if (const cudaError_t rc = cudaMemset(own_, 0, block); rc != cudaSuccess)
      return fmt::format("symmetric memory: rank {} cannot zero its block (cudaMemset: {})", rank(),
                         runtime_error_string(rc));
    if (const cudaError_t rc = cudaDeviceSynchronize(); rc != cudaSuccess)
      return fmt::format(
          "symmetric memory: rank {} cannot zero its block "
          "(cudaDeviceSynchronize: {})",
          rank(), runtime_error_string(rc));
    if (const cudaError_t rc = cudaIpcGetMemHandle(&handle, own_); rc != cudaSuccess)
      return fmt::format(
          "symmetric memory: rank {} cannot export its memory "
          "(cudaIpcGetMemHandle: {}) — symmetric memory on cuda needs CUDA IPC",
          rank(), runtime_error_string(rc));
    return {};
  }

  /// Writes generation 0 (what the block already holds) into this rank's own counter for itself
  /// and waits for it, on the copy stream: the stream memory operations work on this device and
  /// driver. No peer writes that counter, and no peer has the block yet.
  std::string probe_stream_memory_ops() {
    const auto s = static_cast<CUstream>(copy_.native());
    const CUdeviceptr c = counter(rank(), Signal::ready, rank());
    std::string_view call = "cuStreamWriteValue32";
    CUresult rc = driver_.write_value32(s, c, 0, CU_STREAM_WRITE_VALUE_DEFAULT);
    if (rc == CUDA_SUCCESS) {
      call = "cuStreamWaitValue32";
      rc = driver_.wait_value32(s, c, 0, CU_STREAM_WAIT_VALUE_GEQ);
    }
    if (rc != CUDA_SUCCESS)
      return fmt::format(
          "symmetric memory: rank {} cannot use stream memory operations ({}: {}) "
          "— symmetric memory on cuda needs them",
          rank(), call, driver_.describe(rc));
    if (const cudaError_t sync = cudaStreamSynchronize(native(copy_)); sync != cudaSuccess)
      return fmt::format(
          "symmetric memory: rank {} cannot use stream memory operations "
          "(cudaStreamSynchronize: {}) — symmetric memory on cuda needs them",
          rank(), runtime_error_string(sync));
    return {};
  }

  /// Whether this rank's GPU can map the memory of `peer`'s (bus id `theirs`; ours is `mine`).
  /// Ranks on the same GPU always can. Empty if so, else the reason.
  std::string check_peer_device(int peer, const std::string& theirs,
                                const std::string& mine) const {
    if (theirs == mine) return {};
    const auto cannot = [&](std::string_view detail) {
      return fmt::format(
          "symmetric memory: rank {} cannot map the memory of rank {} ({}) — ranks' "
          "GPUs must be able to map each other",
          rank(), peer, detail);
    };
    int other = -1;
    if (const cudaError_t rc = cudaDeviceGetByPCIBusId(&other, theirs.c_str()); rc != cudaSuccess)
      return cannot(fmt::format("its GPU {} is not visible here: cudaDeviceGetByPCIBusId: {}",
                                theirs, runtime_error_string(rc)));
    int can = 0;
    if (const cudaError_t rc = cudaDeviceCanAccessPeer(&can, device_, other); rc != cudaSuccess)
      return cannot(fmt::format("cudaDeviceCanAccessPeer: {}", runtime_error_string(rc)));
    if (can == 0) return cannot(fmt::format("GPU {} has no peer access to GPU {}", mine, theirs));
    return {};
  }

  /// Opens `peer`'s block; empty on success, else the reason.
  std::string open(int peer, const cudaIpcMemHandle_t& handle) {
    void* p = nullptr;
    if (const cudaError_t rc = cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess);
        rc != cudaSuccess)
      return fmt::format(
          "symmetric memory: rank {} cannot map the memory of rank {} "
          "(cudaIpcOpenMemHandle: {}) — ranks' GPUs must be able to map each other",
          rank(), peer, runtime_error_string(rc));
    peers_[static_cast<std::size_t>(peer)] = static_cast<std::byte*>(p);
    return {};
  }

  /// Collective: returns when every rank's `why` is empty. Otherwise every rank releases what it
  /// holds and throws ConfigError with the first reason in rank order (the same line everywhere).
  void agree(const std::string& why) {
    if (symmetric::all_ok(why.empty(), options_.group)) return;
    release();
    std::array<char, kReasonBytes> mine{};
    std::copy_n(why.data(), std::min(why.size(), kReasonBytes - 1), mine.data());
    std::vector<char> all(static_cast<std::size_t>(world()) * kReasonBytes);
    TPX_MPI_CHECK(MPI_Allgather(mine.data(), static_cast<int>(kReasonBytes), MPI_CHAR, all.data(),
                                static_cast<int>(kReasonBytes), MPI_CHAR, options_.group.comm()));
    for (int r = 0; r < world(); ++r) {
      const char* reason = all.data() + static_cast<std::size_t>(r) * kReasonBytes;
      if (reason[0] != '\0') throw ConfigError(c_string(reason, kReasonBytes));
    }
    throw ConfigError("symmetric memory: a rank failed to set up without saying why");
  }

  /// Closes every opened peer block and frees this rank's own; never throws.
  void release() noexcept {
    for (std::byte*& p : peers_) {
      if (p == nullptr) continue;
      if (const cudaError_t rc = cudaIpcCloseMemHandle(p); rc != cudaSuccess)
        warn("cudaIpcCloseMemHandle", rc);
      p = nullptr;
    }
    if (own_ != nullptr) {
      if (const cudaError_t rc = cudaFree(own_); rc != cudaSuccess) warn("cudaFree", rc);
      own_ = nullptr;
    }
  }

  std::size_t stride_;  // the buffer, rounded up to whole pad lines; the pad follows
  int device_ = -1;     // this process's CUDA device
  DriverApi driver_;
  std::byte* own_ = nullptr;       // this rank's block (cudaMalloc)
  std::vector<std::byte*> peers_;  // each peer's block as opened here; nullptr for this rank
};

}  // namespace

std::unique_ptr<SymmetricMemory> make_symmetric_memory(int rank, int world, std::size_t bytes,
                                                       const SymmetricOptions& o, Trace& trace) {
  return std::make_unique<CudaSymmetricMemory>(rank, world, bytes, o, trace);
}

}  // namespace tpx::cuda
