// Stage 05's transport for the overlap primitives of common/ring.h: chunks are pulled out of the
// peers' symmetric memory (symmetric_memory.h, beside this file) by the copy engine, so no SM (on
// the cpu: not the compute thread) spends a cycle moving them, and the only ordering between ranks
// is the signal pad's.
//
// Rank r of N, the k-th use of a buffer (every rank counts alike; generations start at 1):
//
//   all-gather (buffer "ag", one chunk [n, ...] per rank)
//     copy lane   wait done(p) ≥ k − 1 from every peer p       (they have pulled use k − 1)
//                 publish: x_local → own buffer; signal ready(p) = k to every peer p
//                 for j = 1 … N−1, p = (r + j) mod N:
//                   wait ready(p) ≥ k; pull p's buffer → chunk p; signal done(p) = k
//     compute     GEMM on the own chunk at once, then on chunk r+1, r+2, … as each pull lands
//     (each rank pulls from r+1 first, so every buffer has one reader at a time)
//
//   reduce-scatter (buffer "rs", N − 1 chunk slots per rank; one-shot, not a ring)
//     compute     for i = 0 … N−1, c = (r + i + 1) mod N (own chunk last):
//                   c ≠ r: wait done(c) ≥ k − 1; GEMM writes slot c of own buffer;
//                          signal ready(c) = k
//                   c = r: GEMM into a local tensor
//     copy lane   for j = 1 … N−1, p = (r − j) mod N (the order the peers produce chunk r):
//                   wait ready(p) ≥ k; pull slot r of p's buffer → landing j; signal done(p) = k
//     compute     own partial += landing 1 … N−1 (N − 1 adds, as in the ring)
//
// Why one-shot for the reduce-scatter: the ring variant chains N − 1 dependent hops, each gated by
// an add on the compute lane before the next pull can start; here every peer's partial sum is
// written once, straight from its GEMM into symmetric memory (no send buffer, no copy), and
// pulled as soon as it is ready. The bytes are the ring's, (N − 1) chunks pulled per rank, and so
// is the SM cost of the reduction: N − 1 chunk adds on the owner. The price is memory: N − 1
// slots of symmetric memory and N − 1 landing chunks instead of the ring's two plus two.
//
// Pulls are copy-lane spans "<role> pull j/N-1"; the publish is "<role> publish".
//
// The library path (--all-gather nccl-zero-cta; cuda, one GPU per rank, NCCL >= 2.28): the
// all-gathers are NCCL's copy-engine all-gather instead (common/comm/zero_cta.h), in place in a
// registered window: the own chunk is copied into its rows on the compute lane, then one
// ncclAllGather fills the others on NCCL's stream (copy-lane span "<role> all-gather (NCCL
// zero-CTA)"). The GEMM on the own chunk runs beside it; the other chunks all arrive at its end,
// so GEMM step 2 waits for the whole collective instead of one pull. The reduce-scatters stay the
// hand-built one-shot above (NCCL's zero-CTA path has no reduction).
//
// defines: tpx::CopyEngineTransport
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "05_copy_engine_async_tp/symmetric_memory.h"
#include "common/comm/zero_cta.h"
#include "common/ring.h"

namespace tpx {

class CopyEngineTransport final : public ChunkTransport {
 public:
  /// Collective (every rank constructs it). The symmetric buffers are allocated on first use,
  /// sized for what is asked (collectively again, if a later use needs more).
  CopyEngineTransport(int rank, int world, Device device, const SymmetricOptions& options,
                      Trace& trace);
  /// The same with the all-gathers run by NCCL's zero-CTA all-gather on `library`.
  CopyEngineTransport(int rank, int world, Device device, const SymmetricOptions& options,
                      Trace& trace, std::unique_ptr<ZeroCtaComm> library);
  ~CopyEngineTransport() override;

  int rank() const override { return rank_; }
  int world() const override { return world_; }
  std::unique_ptr<ChunkGather> gather(const RingContext& ctx, const Tensor& x_local,
                                      std::string_view role, int queued = -1) override;
  std::unique_ptr<ChunkReduceScatter> reduce_scatter(const RingContext& ctx,
                                                     const Tensor::Shape& shape,
                                                     std::string_view role) override;
  void synchronize() override;
  CommStats take_stats() override;
  std::string name() const override;

  /// One symmetric buffer with the count of its uses (the generation its signals carry).
  struct Buffer {
    std::unique_ptr<SymmetricMemory> memory;
    std::uint64_t uses = 0;
  };

 private:
  /// `b`, holding at least `bytes`, with its use count advanced.
  Buffer& use(Buffer& b, std::size_t bytes);

  int rank_, world_;
  Device device_;
  SymmetricOptions options_;
  Trace& trace_;
  Buffer ag_, rs_;
  CommStats retired_;                     // traffic of buffers replaced by larger ones
  std::unique_ptr<ZeroCtaComm> library_;  // set: the all-gathers are NCCL's
  Stream library_lane_;                   // the stream library all-gathers are issued from
  std::optional<Event> library_done_;     // the last library all-gather is done
};

}  // namespace tpx
