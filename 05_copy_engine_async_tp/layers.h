// Stage 05, copy-engine async tensor parallelism: stage 04's block, sharding, bytes and schedule
// of chunked GEMMs, with the chunks pulled out of the peers' symmetric memory by the copy engine
// (copy_engine.h over symmetric_memory.h, both in this directory, the cuda backend in cuda/)
// instead of passed around a ring by send/recv kernels. On a GPU the transfers then use the DMA
// engines and no SMs; the only synchronisation between ranks is the signal pad's stream-ordered
// generations.
//
//   column forward   y[j] = AG(h) · W[j]   publish h, pull r+1, r+2, …; GEMM each chunk on landing
//   row forward      y = RS(a · W)         GEMMs write peers' slots; each owner pulls and adds
//   backward         as stage 04, on the same two primitives
//
// defines: tpx::async_tp::copy_engine_transport(), tpx::async_tp::CopyEngineAsyncTp,
//          tpx::async_tp::make_copy_engine_async_tp()
#pragma once

#include <memory>
#include <string>

#include "04_overlap_ring/layers.h"

namespace tpx::async_tp {

/// The stage's transport over `group` (collective): CopyEngineTransport, pulls out of symmetric
/// memory made on first use with ctx's timeouts and test faults; under --all-gather
/// nccl-zero-cta its all-gathers are NCCL's zero-CTA ones (ConfigError where they cannot run).
std::unique_ptr<ChunkTransport> copy_engine_transport(const RunContext& ctx, TpGroup& group);

/// Stage 04's OverlapRing on the copy-engine transport: the four linear-layer methods, and all
/// the rest, are stage 04's.
class CopyEngineAsyncTp final : public ring::OverlapRing {
 public:
  explicit CopyEngineAsyncTp(const RunContext& ctx) : OverlapRing(ctx, copy_engine_transport) {}
};

/// The stage's factory: checks that N divides NH, F and S, and (collectively) that every rank is
/// on one node — ConfigError otherwise — then builds.
std::unique_ptr<Parallelism> make_copy_engine_async_tp(const RunContext& ctx);

}  // namespace tpx::async_tp
