// Stage 05, copy-engine async tensor parallelism: stage 04's block, sharding, bytes and schedule
// of chunked GEMMs, with the chunks pulled out of the peers' symmetric memory by the copy engine
// (common/copy_engine.h over common/symmetric_memory.h) instead of passed around a ring by
// send/recv kernels. On a GPU the transfers then use the DMA engines and no SMs; the only
// synchronisation between ranks is the signal pad's stream-ordered generations.
//
//   column forward   y[j] = AG(h) · W[j]     publish h, pull r+1, r+2, …; GEMM each chunk on
//   landing row forward      y = RS(a · W)           GEMMs write peers' slots; each owner pulls and
//   adds backward         as stage 04, on the same two primitives
//
// defines: tpx::async_tp::CopyEngineAsyncTp, tpx::async_tp::make_copy_engine_async_tp()
#pragma once

#include <memory>
#include <string>

#include "04_overlap_ring/layers.h"

namespace tpx::async_tp {

/// Stage 04's OverlapRing on the copy-engine transport: the four linear-layer methods, and all
/// the rest, are stage 04's.
class CopyEngineAsyncTp final : public ring::OverlapRing {
 public:
  explicit CopyEngineAsyncTp(const RunContext& ctx) : OverlapRing(ctx, ChunkMover::copy_engine) {}
};

/// The stage's factory: checks that N divides NH, F and S, and (collectively) that every rank is
/// on one node — ConfigError otherwise — then builds.
std::unique_ptr<Parallelism> make_copy_engine_async_tp(const RunContext& ctx);

}  // namespace tpx::async_tp
