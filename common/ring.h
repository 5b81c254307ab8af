// Collective matmul: an all-gather or reduce-scatter along dim 0, decomposed into N ring steps,
// each step's transfer running on the comm lane while the compute lane multiplies a chunk that is
// already here (Wang et al. 2023, "Overlap Communication with Dependent Computation via
// Decomposition in Large Deep Learning Models"). Stages 04-06 are written with these primitives;
// what moves the bytes is a RingTransport (point-to-point send/recv in stage 04, copy-engine
// pulls later).
//
// Rank r of N holds chunk r = rows [r·n, (r+1)·n) of a tensor split along dim 0 (the sequence).
//
//   AG+GEMM  step i = 0 … N−1: multiply chunk c = (r − i) mod N (rows c of every output), while
//            the comm lane passes chunk c on to r+1 and receives chunk (r − i − 1) mod N from r−1.
//            N GEMMs, N−1 transfers; the first GEMM (own chunk) waits for nothing.
//   GEMM+RS  step i = 0 … N−1: compute the partial rows of chunk c = (r − i − 1) mod N, add the
//            running sum for c received from r−1 (none at step 0) and send it to r+1; at i = N−1
//            the chunk is r's own and the sum is complete. N GEMMs, N−1 transfers of one chunk.
//
// Both move exactly the bus bytes of the bulk collective ((N−1)/N of the full tensor per rank).
// GEMMs and adds are spans on the compute lane ("<role> GEMM step k/N", k = i + 1); transfers on
// the comm lane: "<role> AG step k/N" brings the chunk GEMM step k + 1 needs and runs beside GEMM
// step k; "<role> RS step k/N" carries GEMM step k's running sum and runs beside GEMM step k + 1.
//
// defines: tpx::RingTransport, tpx::P2PTransport, tpx::RingContext, tpx::RingGather,
//          tpx::AlongTheRing, tpx::all_gather_gemm(), tpx::gemm_reduce_scatter()
#pragma once

#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "comm/communicator.h"
#include "stream.h"
#include "tensor.h"
#include "trace.h"

namespace tpx {

/// How a ring step's chunk travels from rank r to rank r+1.
class RingTransport {
 public:
  virtual ~RingTransport() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  /// Queues one ring step: `send` goes to rank+1 while `recv` is filled from rank−1, once `after`
  /// (recorded by the caller) is reached. Returns an event that completes when both are done.
  /// `what` names the step on the comm lane and in the flight recorder.
  virtual Event shift(const Tensor& send, const Tensor& recv, const Event& after,
                      const std::string& what) = 0;
};

/// Stage 04's transport: a Communicator::sendrecv per step, issued on a comm stream of its own
/// (cpu: a thread running MPI_Irecv/MPI_Isend; cuda: ncclSend/ncclRecv in a group).
class P2PTransport final : public RingTransport {
 public:
  /// `comm` and `trace` must outlive the transport.
  P2PTransport(Communicator& comm, Device device, Trace& trace);
  ~P2PTransport() override;
  int rank() const override { return comm_.rank(); }
  int world() const override { return comm_.size(); }
  Event shift(const Tensor& send, const Tensor& recv, const Event& after,
              const std::string& what) override;
  /// Blocks the host until every transfer queued so far is done.
  void synchronize() const { stream_.synchronize(); }

 private:
  Communicator& comm_;
  Trace& trace_;
  Stream stream_;  // the comm lane
};

/// What a ring primitive runs on: the transport, the trace, the GEMMs' operand type. The compute
/// lane is the device's default stream (the caller's thread on the cpu).
struct RingContext {
  RingTransport& transport;
  Trace& trace;
  DType compute = DType::f32;
};

/// A ring all-gather in flight: full() [N·n, ...] fills chunk by chunk. The constructor puts the
/// own chunk in place (a compute-lane span "<role> copy own chunk") and queues `queued` of the
/// N − 1 transfers on the comm lane (all by default); advance() queues the others one at a time,
/// so another ring can interleave its transfers with these.
class RingGather {
 public:
  RingGather(const RingContext& ctx, const Tensor& x_local, std::string_view role, int queued = -1);

  const Tensor& full() const { return full_; }
  /// Rows [c·n, (c+1)·n) of full(): chunk c.
  Tensor chunk(int c) const;
  /// Queues the next transfer; false once all N − 1 are queued.
  bool advance();
  /// Makes the compute lane wait until chunk c is here (own chunk: at once), queueing first
  /// whatever transfers it needs.
  void wait_chunk(int c);
  /// Queues the remaining transfers and makes the compute lane wait until every chunk is here.
  void wait_all();

 private:
  RingTransport* transport_;
  Tensor full_;
  int rank_, world_;
  std::string role_;
  Event own_;                   // the own chunk is in place
  std::vector<Event> arrived_;  // arrived_[i]: step i's chunk, (rank − i − 1) mod N, is here
};

/// AG+GEMM: out[j] = gather(x_local) · op(w[j]) for every j, with op(w) = wᵀ when trans_w, each
/// out[j] [N·n, ..., cols_j] written chunk by chunk as the chunks arrive. The weights share each
/// gathered chunk (Q, K and V; gate and up). Returns the gathered input [N·n, ...].
Tensor all_gather_gemm(const RingContext& ctx, const Tensor& x_local, std::span<const Tensor> w,
                       bool trans_w, std::span<const Tensor> out, std::string_view role);

/// What a GEMM+RS ring can carry along (the column-parallel backward uses both).
struct AlongTheRing {
  /// Another all-gather, advanced by one transfer after each of this ring's transfers, so the
  /// two rings share the comm lane step by step instead of one waiting for the whole other.
  RingGather* gather = nullptr;
  /// Compute-lane work run after the last GEMM and before the wait for the last transfer, so
  /// that independent work hides that transfer.
  std::function<void()> before_last_wait;
};

/// GEMM+RS: this rank's rows [n, ..., cols] of Σ_ranks Σ_j a[j] · op(w[j]), with a[j]
/// [N·n, ..., in_j].
Tensor gemm_reduce_scatter(const RingContext& ctx, std::span<const Tensor> a,
                           std::span<const Tensor> w, bool trans_w, std::string_view role,
                           const AlongTheRing& along = {});

}  // namespace tpx
