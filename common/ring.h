// Collective matmul: an all-gather or reduce-scatter along dim 0, decomposed into N ring steps,
// each step's transfer running on the comm lane while the compute lane multiplies a chunk that is
// already here (Wang et al. 2023, "Overlap Communication with Dependent Computation via
// Decomposition in Large Deep Learning Models"). Stages 04-06 are written with these primitives;
// what moves the bytes is a ChunkTransport, which also fixes the order of the chunks: below is
// the ring of point-to-point send/recv of stage 04 (P2PTransport); stage 05's copy-engine pulls
// are described in 05_copy_engine_async_tp/copy_engine.h.
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
// defines: tpx::ChunkTransport, tpx::P2PTransport, tpx::RingContext, tpx::ChunkGather,
//          tpx::ChunkReduceScatter, tpx::AlongTheRing, tpx::all_gather_gemm(),
//          tpx::gemm_reduce_scatter()
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "comm/communicator.h"
#include "parallel.h"
#include "stream.h"
#include "tensor.h"
#include "trace.h"

namespace tpx {

class ChunkGather;
class ChunkReduceScatter;
struct RingContext;

/// How the chunks of the primitives below travel between ranks: a transport starts an all-gather
/// or a reduce-scatter whose chunks the primitive then consumes or produces one per step. Stage 04
/// passes chunks around a ring with send/recv (P2PTransport); stage 05 pulls them out of peers'
/// symmetric memory with the copy engine (CopyEngineTransport,
/// 05_copy_engine_async_tp/copy_engine.h).
class ChunkTransport {
 public:
  virtual ~ChunkTransport() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  /// Starts gathering x_local [n, ...] of every rank into [N·n, ...]; `queued` of the transfers
  /// are issued now (all by default), the others by advance() or a wait.
  virtual std::unique_ptr<ChunkGather> gather(const RingContext& ctx, const Tensor& x_local,
                                              std::string_view role, int queued = -1) = 0;
  /// Starts a reduce-scatter whose result on this rank has `shape` [n, ..., cols], in
  /// ctx.activations.
  virtual std::unique_ptr<ChunkReduceScatter> reduce_scatter(const RingContext& ctx,
                                                             const Tensor::Shape& shape,
                                                             std::string_view role) = 0;
  /// Blocks the host until every transfer issued so far is done.
  virtual void synchronize() = 0;
  /// Traffic the transport moved itself, not through a Communicator (which counts its own),
  /// since the last call; resets the counters.
  virtual CommStats take_stats() { return {}; }
  /// Words for the stage header.
  virtual std::string name() const = 0;
};

/// Stage 04's transport: a Communicator::sendrecv per ring step, issued on a comm stream of its
/// own (cpu: a thread running MPI_Irecv/MPI_Isend; cuda: ncclSend/ncclRecv in a group).
class P2PTransport final : public ChunkTransport {
 public:
  /// `comm` and `trace` must outlive the transport.
  P2PTransport(Communicator& comm, Device device, Trace& trace);
  ~P2PTransport() override;
  int rank() const override { return comm_.rank(); }
  int world() const override { return comm_.size(); }
  std::unique_ptr<ChunkGather> gather(const RingContext& ctx, const Tensor& x_local,
                                      std::string_view role, int queued = -1) override;
  std::unique_ptr<ChunkReduceScatter> reduce_scatter(const RingContext& ctx,
                                                     const Tensor::Shape& shape,
                                                     std::string_view role) override;
  void synchronize() override { stream_.synchronize(); }
  std::string name() const override { return "ring of send/recv on a comm stream"; }

  /// Queues one ring step: `send` goes to rank+1 while `recv` is filled from rank−1, once `after`
  /// (recorded by the caller) is reached. Returns an event that completes when both are done.
  /// `what` names the step on the comm lane and in the flight recorder.
  Event shift(const Tensor& send, const Tensor& recv, const Event& after, const std::string& what);

 private:
  Communicator& comm_;
  Trace& trace_;
  Stream stream_;  // the comm lane
};

/// What a ring primitive runs on: the transport, the trace, the GEMMs' operand type, and the dtype
/// activations are stored in (the outputs and the partial sums that travel: bf16 under the
/// mixed-precision recipe, each hop adding in fp32 and rounding once). The compute lane is the
/// device's default stream (the caller's thread on the cpu).
struct RingContext {
  ChunkTransport& transport;
  Trace& trace;
  DType compute = DType::f32;
  DType activations = DType::f32;
};

/// An all-gather in flight: full() [N·n, ...] fills chunk by chunk. Made by a transport, which
/// has put the own chunk in place (a compute-lane span "<role> copy own chunk") and issued some or
/// all of the transfers.
class ChunkGather {
 public:
  virtual ~ChunkGather() = default;
  const Tensor& full() const { return full_; }
  /// Rows [c·n, (c+1)·n) of full(): chunk c.
  Tensor chunk(int c) const;
  /// The chunk a consumer takes at step i = 0 … N−1, in the order they arrive (step 0: the own
  /// chunk, which is here at once).
  virtual int chunk_at(int i) const = 0;
  /// Issues the next transfer; false once all are issued.
  virtual bool advance() = 0;
  /// Makes the compute lane wait until chunk c is here, issuing first whatever transfers it needs.
  virtual void wait_chunk(int c) = 0;
  /// Issues the remaining transfers and makes the compute lane wait until every chunk is here.
  void wait_all();

 protected:
  /// Allocates full() and copies x_local into its own chunk on the compute lane; own_ marks it.
  ChunkGather(const RingContext& ctx, const Tensor& x_local, std::string_view role);
  /// The same with `full` [N·n, ...] given (memory a library gathers into).
  ChunkGather(const RingContext& ctx, const Tensor& x_local, std::string_view role, Tensor full);
  Tensor full_;
  int rank_, world_;
  std::string role_;
  Event own_;  // the own chunk is in place (and x_local read)
};

/// A reduce-scatter in flight, fed one chunk of partial sums per step: for i = 0 … N−1 the
/// primitive writes the partial sums of chunk chunk_at(i) into target(i) and calls computed(i);
/// after the last step (the own chunk) finish() combines what the peers sent.
class ChunkReduceScatter {
 public:
  virtual ~ChunkReduceScatter() = default;
  virtual int chunk_at(int i) const = 0;
  /// Where step i's partial sums go [n, ..., cols]; the compute lane may first wait until the
  /// buffer is free again.
  virtual Tensor target(int i) = 0;
  /// Step i < N − 1 has written target(i): send it on its way.
  virtual void computed(int i) = 0;
  /// After the last step: the compute lane waits for the peers' partial sums of this rank's
  /// chunk and adds them; returns the complete [n, ..., cols].
  virtual Tensor finish() = 0;
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
  ChunkGather* gather = nullptr;
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
