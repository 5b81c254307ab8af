// The NCCL backend: collectives and point-to-point transfers on device memory, one GPU per rank.
//
// The unique id travels over MPI (rank 0 creates it). NCCL runs on the communicator's own
// stream, ordered against the caller's stream with events: the comm stream waits for what the
// caller issued before the op, and the caller's stream waits for the op before its later work.
// The host does not block (barrier() excepts). Completion is observed by the watchdog thread,
// which polls each op's end event and NCCL's asynchronous error state.
//
// Lifetime: the caching allocator is not stream-aware, so every op holds references to its
// tensors until its end event has completed. Otherwise a tensor the caller drops right after the
// call could be handed to the next allocation and written by a stream that is not ordered after
// the comm stream while NCCL still reads or writes it.
//
// make_communicator() reaches this file only when every rank has its own GPU: NCCL refuses two
// ranks on one device, and ranks that share one use the host-staged MPI backend instead.
//
// The zero-CTA variant (common/comm/zero_cta.h) is the same communicator created with
// NCCL_CTA_POLICY_ZERO, plus a window of ncclMemAlloc'd memory registered symmetrically in it.
#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <deque>
#include <exception>
#include <mutex>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "backends.h"
#include "common/check.h"
#include "common/cuda/check.h"
#include "common/cuda/device.h"
#include "common/cuda/nccl_check.h"
#include "common/ops.h"

namespace tpx {
namespace {

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::f32:
      return ncclFloat32;
    case DType::bf16:
      return ncclBfloat16;  // summed in fp32 per hop, rounded once
    case DType::e4m3:
    case DType::e5m2:
    case DType::u8:
      return ncclUint8;  // moved as bytes, never summed
    case DType::i32:
      return ncclInt32;
  }
  return ncclUint8;
}

std::size_t count(const Tensor& t) {
  return static_cast<std::size_t>(t.numel());
}

class NcclCommunicator final : public Communicator {
 public:
  /// `zero_cta`: created with NCCL_CTA_POLICY_ZERO (NCCL >= 2.28; the caller has checked).
  NcclCommunicator(int rank, int size, const CommOptions& o, bool zero_cta = false)
      : Communicator(rank, size, o), stream_(Stream::create(Device::cuda)), zero_cta_(zero_cta) {
    ncclUniqueId id{};
    if (rank == 0) TPX_NCCL_CHECK(ncclGetUniqueId(&id));
    TPX_MPI_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, o.group.comm()));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
    if (zero_cta) {
      config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
      config.commName = "tpx zero-CTA all-gather";
    }
#else
    TPX_CHECK(!zero_cta, "NCCL {} has no zero-CTA policy", NCCL_VERSION_CODE);
#endif
    TPX_NCCL_CHECK(ncclCommInitRankConfig(&comm_, size, id, rank, &config));
    scratch_ = Tensor::empty({1}, DType::f32, Device::cuda);
    ops::fill(scratch_, 0.0f);  // Tensor::zeros is host-only
    cuda::synchronize();        // the fill ran on the current stream, not on the comm stream
    start_watchdog([this] { return poll(); });
  }

  ~NcclCommunicator() override {
    // While an exception unwinds, the other ranks may be inside (or about to issue) collectives
    // that this rank will never join: ncclCommDestroy would wait for those ops forever (and the
    // watchdog is gone by then), so the communicator is aborted instead.
    bool clean = std::uncaught_exceptions() == 0;
    try {
      if (clean) stream_.synchronize();
    } catch (const std::exception& e) {
      fmt::print(stderr, "tpx: nccl communicator: {}\n", e.what());
      clean = false;
    }
    shutdown();
    if (clean)
      ncclCommDestroy(comm_);
    else
      ncclCommAbort(comm_);
  }

  std::string name() const override {
    return zero_cta_ ? "nccl, zero-CTA policy (device memory)" : "nccl (device memory)";
  }
  ncclComm_t native() const {
    return comm_;
  }
  /// Host waits for every op issued so far.
  void drain() {
    stream_.synchronize();
  }

 protected:
  bool blocks_caller() const override {
    return false;
  }  // queued on the stream

  bool accepts(Device d) const override {
    return d == Device::cuda;
  }

  void do_all_gather(const Tensor& in, const Tensor& out, const Stream& s) override {
    enter(s);
    nccl(ncclAllGather(in.raw(), out.raw(), count(in), nccl_type(in.dtype()), comm_, cs()),
         "ncclAllGather");
    leave(s, {in, out});
  }

  void do_reduce_scatter(const Tensor& in, const Tensor& out, const Stream& s) override {
    enter(s);
    nccl(ncclReduceScatter(in.raw(), out.raw(), count(out), nccl_type(in.dtype()), ncclSum, comm_,
                           cs()),
         "ncclReduceScatter");
    leave(s, {in, out});
  }

  void do_all_reduce(const Tensor& t, const Stream& s, bool max) override {
    enter(s);
    nccl(ncclAllReduce(t.raw(), t.raw(), count(t), nccl_type(t.dtype()), max ? ncclMax : ncclSum,
                       comm_, cs()),
         "ncclAllReduce");
    leave(s, {t});
  }

  void do_broadcast(const Tensor& t, int root, const Stream& s) override {
    enter(s);
    nccl(ncclBroadcast(t.raw(), t.raw(), count(t), nccl_type(t.dtype()), root, comm_, cs()),
         "ncclBroadcast");
    leave(s, {t});
  }

  void do_sendrecv(const Tensor& send, int dst, const Tensor& recv, int src,
                   const Stream& s) override {
    enter(s);
    nccl(ncclGroupStart(), "ncclGroupStart");
    if (send.defined())
      nccl(ncclSend(send.raw(), count(send), nccl_type(send.dtype()), dst, comm_, cs()),
           "ncclSend");
    if (recv.defined())
      nccl(ncclRecv(recv.raw(), count(recv), nccl_type(recv.dtype()), src, comm_, cs()),
           "ncclRecv");
    nccl(ncclGroupEnd(), "ncclGroupEnd");
    leave(s, {send, recv});
  }

  bool has_all_to_all() const override {
    return true;
  }

  // The ragged all-to-all as one group of point-to-point calls, a send and a receive per peer
  // (NCCL has no all-to-all-v of its own; a group lets it run them all at once). A count of 0 is
  // skipped on both sides: the peer's matching count is 0 too.
  void do_all_to_all_v(const Tensor& send, std::span<const std::int64_t> send_counts,
                       const Tensor& recv, std::span<const std::int64_t> recv_counts,
                       const Stream& s) override {
    enter(s);
    const std::size_t element = dtype_size(send.dtype());
    const ncclDataType_t type = nccl_type(send.dtype());
    nccl(ncclGroupStart(), "ncclGroupStart");
    std::size_t sent = 0, received = 0;
    for (std::size_t peer = 0; peer < send_counts.size(); ++peer) {
      const auto out = static_cast<std::size_t>(send_counts[peer]);
      const auto in = static_cast<std::size_t>(recv_counts[peer]);
      if (out > 0)
        nccl(ncclSend(static_cast<const char*>(send.raw()) + sent * element, out, type,
                      static_cast<int>(peer), comm_, cs()),
             "ncclSend");
      if (in > 0)
        nccl(ncclRecv(static_cast<char*>(recv.raw()) + received * element, in, type,
                      static_cast<int>(peer), comm_, cs()),
             "ncclRecv");
      sent += out;
      received += in;
    }
    nccl(ncclGroupEnd(), "ncclGroupEnd");
    leave(s, {send, recv});
  }

  void do_barrier() override {
    // A one-element all-reduce on the comm stream, then the host waits for it (and so for every
    // op issued before it); the watchdog watches the wait like any op.
    nccl(ncclAllReduce(scratch_.raw(), scratch_.raw(), 1, ncclFloat32, ncclSum, comm_, cs()),
         "ncclAllReduce (barrier)");
    leave(stream_);
    stream_.synchronize();
  }

  void issued(std::uint64_t seq) override {
    std::lock_guard lock(mu_);
    // Also reaped here: without a watchdog thread (no MPI_THREAD_MULTIPLE) nothing else would,
    // and the queue would hold every op's event and tensors until the communicator is destroyed.
    reap();
    pending_.push_back({seq, last_, std::exchange(keep_, {})});
  }

 private:
  cudaStream_t cs() const {
    return static_cast<cudaStream_t>(stream_.native());
  }

  /// The comm stream waits for the work the caller queued on `s` so far.
  void enter(const Stream& s) {
    Event ready(Device::cuda);
    ready.record(s);
    ready.wait(stream_);
  }
  /// The caller's stream waits for the op just queued on the comm stream; `keep` (the op's
  /// tensors) stay referenced until the op is seen complete (see Lifetime above).
  void leave(const Stream& s, std::array<Tensor, 2> keep = {}) {
    Event done(Device::cuda);
    done.record(stream_);
    done.wait(s);
    last_ = done;
    keep_ = std::move(keep);
  }

  /// Marks the ops whose end event has completed done and drops their tensors, oldest first.
  /// Caller holds mu_; runs on the issuing thread and on the watchdog thread.
  void reap() {
    while (!pending_.empty() && pending_.front().done.ready()) {
      recorder_.finish(pending_.front().seq, OpState::done);
      pending_.pop_front();
    }
  }

  void nccl(ncclResult_t rc, const char* call) {
    if (rc == ncclSuccess || rc == ncclInProgress) return;
    const char* last = ncclGetLastError(comm_);
    op_failed(fmt::format("{} failed: {}{}{}", call, ncclGetErrorString(rc),
                          (last && *last) ? ": " : "", last ? last : ""));
  }

  /// On the watchdog thread: marks finished ops done; reports NCCL's asynchronous errors.
  std::string poll() {
    {
      std::lock_guard lock(mu_);
      reap();
    }
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess &&
        async != ncclInProgress)
      return fmt::format("NCCL asynchronous error: {}", ncclGetErrorString(async));
    return {};
  }

  /// An op issued whose end event has not been seen complete, with the tensors it uses.
  struct Pending {
    std::uint64_t seq;
    Event done;
    std::array<Tensor, 2> keep;
  };

  Stream stream_;
  bool zero_cta_;
  ncclComm_t comm_ = nullptr;
  Tensor scratch_;
  Event last_{Device::cuda};    // the end event of the op being issued (set by leave())
  std::array<Tensor, 2> keep_;  // its tensors (set by leave())
  std::mutex mu_;
  std::deque<Pending> pending_;  // guarded by mu_
};

/// ncclMemAlloc'd memory registered as a symmetric window of a communicator. Registering and
/// deregistering are collective; the memory itself is freed when the last view of it goes (views
/// are tensors borrowing it), which may be after the window is deregistered.
class Window {
 public:
  Window(ncclComm_t comm, std::size_t bytes) : comm_(comm) {
    void* p = nullptr;
    TPX_NCCL_CHECK(ncclMemAlloc(&p, bytes));
    memory_ = std::shared_ptr<void>(p, [](void* q) { ncclMemFree(q); });
    TPX_NCCL_CHECK(ncclCommWindowRegister(comm_, p, bytes, &window_, NCCL_WIN_COLL_SYMMETRIC));
    bytes_ = bytes;
  }
  /// Collective, like the registration; skipped while an exception unwinds (the communicator is
  /// aborted then, which releases its windows).
  ~Window() {
    if (std::uncaught_exceptions() == 0) ncclCommWindowDeregister(comm_, window_);
  }
  Window(const Window&) = delete;
  Window& operator=(const Window&) = delete;

  std::size_t bytes() const { return bytes_; }
  Tensor view(const Tensor::Shape& shape, DType dtype) const {
    return Tensor::borrow(memory_.get(), shape, dtype, Device::cuda, memory_);
  }

 private:
  ncclComm_t comm_;
  std::shared_ptr<void> memory_;
  ncclWindow_t window_ = nullptr;
  std::size_t bytes_ = 0;
};

class NcclZeroCtaComm final : public ZeroCtaComm {
 public:
  NcclZeroCtaComm(int rank, int size, const CommOptions& o)
      : comm_(std::make_unique<NcclCommunicator>(rank, size, o, /*zero_cta=*/true)) {}
  ~NcclZeroCtaComm() override {
    // The window goes before the communicator; nothing may still be gathering into it.
    if (window_ && std::uncaught_exceptions() == 0) comm_->drain();
    window_.reset();
  }

  Communicator& comm() override { return *comm_; }

  Tensor window(const Tensor::Shape& shape, DType dtype) override {
    std::size_t bytes = dtype_size(dtype);
    for (const std::int64_t d : shape) bytes *= static_cast<std::size_t>(d);
    if (!window_ || window_->bytes() < bytes) {
      // Every rank grows it at the same call. Work already queued may still read the old window
      // (the GEMMs on the compute stream) or write it (the last all-gather): wait for both.
      if (window_) {
        comm_->drain();
        cuda::synchronize();
      }
      window_.reset();
      window_ = std::make_unique<Window>(comm_->native(), round_up(bytes));
    }
    return window_->view(shape, dtype);
  }

 private:
  static std::size_t round_up(std::size_t bytes) {
    constexpr std::size_t a = NCCL_WIN_REQUIRED_ALIGNMENT;
    return (std::max<std::size_t>(bytes, 1) + a - 1) / a * a;
  }

  std::unique_ptr<NcclCommunicator> comm_;
  std::unique_ptr<Window> window_;  // destroyed (deregistered) before comm_
};

}  // namespace

int nccl_version(bool built) {
  if (built) return NCCL_VERSION_CODE;
  int v = 0;
  TPX_NCCL_CHECK(ncclGetVersion(&v));
  return v;
}

std::unique_ptr<ZeroCtaComm> make_nccl_zero_cta_comm(const CommOptions& o) {
  cuda::ensure_initialized();
  return std::make_unique<NcclZeroCtaComm>(o.group.rank(), o.group.size(), o);
}

std::unique_ptr<Communicator> make_nccl_communicator(const CommOptions& o) {
  cuda::ensure_initialized();
  return std::make_unique<NcclCommunicator>(o.group.rank(), o.group.size(), o);
}

std::string local_gpu_identity() {
  cuda::ensure_initialized();
  int device = 0;
  TPX_CUDA_CHECK(cudaGetDevice(&device));
  std::array<char, 64> bus{};
  TPX_CUDA_CHECK(cudaDeviceGetPCIBusId(bus.data(), static_cast<int>(bus.size()), device));
  std::array<char, MPI_MAX_PROCESSOR_NAME> host{};
  int len = 0;
  MPI_Get_processor_name(host.data(), &len);
  return fmt::format("{} {}", std::string_view(host.data(), static_cast<std::size_t>(len)),
                     bus.data());
}

}  // namespace tpx
