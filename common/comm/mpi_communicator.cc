// The MPI backend: collectives and point-to-point transfers on host memory over a duplicate of
// the group's communicator (MPI_COMM_WORLD unless a mesh splits the job). Tensors on a cuda device
// are staged: the caller's stream is drained, the data is copied into a host buffer, moved by MPI
// and copied back (the path for several ranks sharing one GPU, where NCCL cannot run).
//
// The calls block the calling thread; the watchdog thread (watchdog.h) watches each one against
// the timeout and aborts the job with a diagnosis if it hangs. MPI errors come back as codes
// (MPI_ERRORS_RETURN on the duplicate) and are reported through the same path.
#include <mpi.h>

#include <array>
#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "backends.h"
#include "common/check.h"
#include "common/ops.h"

namespace tpx {
namespace {

MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::bf16:
      return MPI_UINT16_T;  // the bits; sums go through bf16_sum
    case DType::e4m3:
    case DType::e5m2:
    case DType::u8:
      return MPI_UINT8_T;
    case DType::i32:
      return MPI_INT32_T;
  }
  return MPI_BYTE;
}

/// MPI has no bf16 type: bf16 values travel as 16-bit patterns and are summed by this user
/// operation, which adds each pair in fp32 and rounds the sum once to nearest even (what NCCL
/// does for a bf16 reduction at each hop).
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = bf16_bits(bf16_value(a[i]) + bf16_value(b[i]));
}

std::string mpi_error_string(int code) {
  std::array<char, MPI_MAX_ERROR_STRING> text{};
  int len = 0;
  MPI_Error_string(code, text.data(), &len);
  return {text.data(), static_cast<std::size_t>(len)};
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(int rank, int size, MPI_Comm comm, const CommOptions& o, std::string name)
      : Communicator(rank, size, o), comm_(comm), name_(std::move(name)) {
    MPI_Op_create(&bf16_sum, /*commute=*/1, &bf16_sum_);
    start_watchdog();
  }
  ~MpiCommunicator() override {
    shutdown();
    MPI_Op_free(&bf16_sum_);
    MPI_Comm_free(&comm_);
  }

  std::string name() const override { return name_; }

 protected:
  bool accepts(Device) const override { return true; }

  void do_all_gather(const Tensor& in, const Tensor& out, const Stream& s) override {
    const Tensor hin = to_host(in, 0, s), hout = host_buffer(out, 1);
    check(MPI_Allgather(hin.raw(), count(in), mpi_type(in.dtype()), hout.raw(), count(in),
                        mpi_type(out.dtype()), comm_),
          "MPI_Allgather");
    from_host(hout, out, s);
  }

  void do_reduce_scatter(const Tensor& in, const Tensor& out, const Stream& s) override {
    const Tensor hin = to_host(in, 0, s), hout = host_buffer(out, 1);
    check(MPI_Reduce_scatter_block(hin.raw(), hout.raw(), count(out), mpi_type(in.dtype()),
                                   sum_op(in.dtype()), comm_),
          "MPI_Reduce_scatter_block");
    from_host(hout, out, s);
  }

  void do_all_reduce(const Tensor& t, const Stream& s, bool max) override {
    const Tensor h = to_host(t, 0, s);
    check(MPI_Allreduce(MPI_IN_PLACE, h.raw(), count(t), mpi_type(t.dtype()),
                        max ? MPI_MAX : sum_op(t.dtype()), comm_),
          "MPI_Allreduce");
    from_host(h, t, s);
  }

  void do_broadcast(const Tensor& t, int root, const Stream& s) override {
    const Tensor h = to_host(t, 0, s);
    check(MPI_Bcast(h.raw(), count(t), mpi_type(t.dtype()), root, comm_), "MPI_Bcast");
    from_host(h, t, s);
  }

  void do_sendrecv(const Tensor& send, int dst, const Tensor& recv, int src,
                   const Stream& s) override {
    // A non-blocking pair completed together: the receive is posted first so that a peer's
    // message finds it, and neither side can block the other (MPI_PROC_NULL for a missing side).
    const Tensor hs = send.defined() ? to_host(send, 0, s) : Tensor();
    const Tensor hr = recv.defined() ? host_buffer(recv, 1) : Tensor();
    std::array<MPI_Request, 2> req{MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    check(MPI_Irecv(hr.defined() ? hr.raw() : nullptr, hr.defined() ? count(recv) : 0,
                    hr.defined() ? mpi_type(recv.dtype()) : MPI_BYTE,
                    hr.defined() ? src : MPI_PROC_NULL, kTag, comm_, &req[0]),
          "MPI_Irecv");
    check(MPI_Isend(hs.defined() ? hs.raw() : nullptr, hs.defined() ? count(send) : 0,
                    hs.defined() ? mpi_type(send.dtype()) : MPI_BYTE,
                    hs.defined() ? dst : MPI_PROC_NULL, kTag, comm_, &req[1]),
          "MPI_Isend");
    wait_all(req);
    if (hr.defined()) from_host(hr, recv, s);
  }

  void do_barrier() override { check(MPI_Barrier(comm_), "MPI_Barrier"); }

  bool has_all_to_all() const override { return true; }

  void do_all_to_all_v(const Tensor& send, std::span<const std::int64_t> send_counts,
                       const Tensor& recv, std::span<const std::int64_t> recv_counts,
                       const Stream& s) override {
    // MPI_Alltoallv takes int counts and displacements in elements: each must fit.
    std::vector<int> sc, sd, rc, rd;
    displacements(send_counts, sc, sd);
    displacements(recv_counts, rc, rd);
    const Tensor hs = to_host(send, 0, s), hr = host_buffer(recv, 1);
    check(MPI_Alltoallv(hs.raw(), sc.data(), sd.data(), mpi_type(send.dtype()), hr.raw(), rc.data(),
                        rd.data(), mpi_type(recv.dtype()), comm_),
          "MPI_Alltoallv");
    from_host(hr, recv, s);
  }

 private:
  static constexpr int kTag = 77;

  MPI_Op sum_op(DType d) const { return d == DType::bf16 ? bf16_sum_ : MPI_SUM; }

  void check(int rc, const char* call) {
    if (rc != MPI_SUCCESS) op_failed(fmt::format("{} failed: {}", call, mpi_error_string(rc)));
  }

  /// Waits for both requests by polling, yielding the core between polls. MPI_Waitall would spin
  /// for the whole transfer; on a comm stream's thread that core is often the compute lane's too
  /// (the cpu backend runs a rank's two lanes on two threads, and mpirun binds a rank to a core),
  /// so a spinning wait would slow the very GEMMs the transfer is meant to hide behind. The polls
  /// also drive MPI's progress engine, which moves the bytes.
  void wait_all(std::array<MPI_Request, 2>& req) {
    for (;;) {
      int done = 0;
      check(MPI_Testall(2, req.data(), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
      if (done) return;
      std::this_thread::yield();
    }
  }

  /// MPI's int counts and displacements for element counts laid out one after the other.
  static void displacements(std::span<const std::int64_t> counts, std::vector<int>& c,
                            std::vector<int>& d) {
    std::int64_t at = 0;
    for (const std::int64_t n : counts) {
      TPX_CHECK(n <= INT_MAX && at <= INT_MAX, "MPI counts are int; an all-to-all of {} at {}", n,
                at);
      c.push_back(static_cast<int>(n));
      d.push_back(static_cast<int>(at));
      at += n;
    }
  }

  static int count(const Tensor& t) {
    TPX_CHECK(t.numel() <= INT_MAX, "MPI counts are int; {} has too many elements", t.describe());
    return static_cast<int>(t.numel());
  }

  /// A host view of `t`: t itself on the cpu, else a staging buffer of the same shape.
  /// Two lanes may call at once (a pipeline's send lane uses slot 0 while its receive lane uses
  /// slot 1): the map is guarded; each slot is used by one lane at a time.
  Tensor host_buffer(const Tensor& t, int slot) {
    if (t.device() == Device::cpu) return t;
    std::lock_guard lock(staging_mutex_);
    Tensor& buf = staging_[{slot, t.dtype()}];
    if (!buf.defined() || buf.numel() < t.numel())
      buf = Tensor::empty({t.numel()}, t.dtype(), Device::cpu);
    return buf.slice0(0, t.numel()).reshape(t.shape());
  }
  /// host_buffer(t) holding t's values once the work queued on `s` is done.
  Tensor to_host(const Tensor& t, int slot, const Stream& s) {
    if (t.device() == Device::cpu) return t;
    s.synchronize();
    Tensor h = host_buffer(t, slot);
    ops::copy(t, h);
    return h;
  }
  /// Copies the result back into t once the work queued on `s` is done: that work may still read
  /// or write t (a receive-only sendrecv never went through to_host(), so nothing drained `s`).
  /// ops::copy returns once the copy is complete, so t is ready for any stream afterwards.
  static void from_host(const Tensor& h, const Tensor& t, const Stream& s) {
    if (t.device() == Device::cpu) return;
    s.synchronize();
    ops::copy(h, t);
  }

  MPI_Comm comm_;
  MPI_Op bf16_sum_ = MPI_OP_NULL;
  std::string name_;
  std::mutex staging_mutex_;
  std::map<std::pair<int, DType>, Tensor> staging_;  // host buffers for cuda tensors
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(const CommOptions& o, std::string name) {
  MPI_Comm comm = MPI_COMM_NULL;
  TPX_MPI_CHECK(MPI_Comm_dup(o.group.comm(), &comm));
  TPX_MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  return std::make_unique<MpiCommunicator>(rank, size, comm, o, std::move(name));
}

}  // namespace tpx
