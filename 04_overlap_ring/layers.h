// Stage 04, ring-overlapped tensor + sequence parallelism: stage 03's block, sharding and bytes,
// with each all-gather + GEMM and each GEMM + reduce-scatter decomposed into N ring steps whose
// transfers run on the comm lane while the compute lane multiplies a chunk that is already here
// (common/ring.h: all_gather_gemm, gemm_reduce_scatter).
//
//   column forward   y[j] = AG(h) · W[j]           all_gather_gemm   (qkv, gate/up)
//   row forward      y = RS(a · W)                 gemm_reduce_scatter (o, down)
//   row backward     da = AG(dy) · Wᵀ              all_gather_gemm on Wᵀ; dW = aᵀ · AG(dy) after
//   column backward  dh = RS(Σ dy[j] · W[j]ᵀ)      gemm_reduce_scatter, with the re-gather of h
//                    dW[j] = AG(h)ᵀ · dy[j]        interleaved on the comm lane; the dW GEMMs
//                                                  hide the dX ring's last transfer
//
// defines: tpx::ring::OverlapRing, tpx::ring::make_overlap_ring()
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "03_sequence_parallel/layers.h"
#include "common/ring.h"

namespace tpx::ring {

/// Makes the transport that moves the ring primitives' chunks over the stage's group
/// (collective: every rank of the group calls it).
using MakeTransport = std::function<std::unique_ptr<ChunkTransport>(const RunContext&, TpGroup&)>;

/// Stage 04's transport: P2PTransport, a ring of send/recv on the group's communicator.
std::unique_ptr<ChunkTransport> send_recv_ring(const RunContext& ctx, TpGroup& group);

/// Stage 03's Parallelism with its four linear-layer methods replaced by ring primitives over
/// point-to-point transfers (or another ChunkTransport). Everything else (sharding, norm-gain
/// all-reduce, gathers for --check) is stage 03's.
class OverlapRing : public sp::SequenceParallel {
 public:
  /// `make` says how the chunks travel: stage 04's ring of send/recv, or the transport a later
  /// stage brings (stage 05's copy-engine pulls). The schedule of GEMMs is the same.
  explicit OverlapRing(const RunContext& ctx, const MakeTransport& make = send_recv_ring);
  std::string comm_name() const override;

  ColumnResult column_forward(const Tensor& h, std::span<const Tensor> w,
                              std::string_view role) override;
  Tensor column_backward(const Tensor& saved, std::span<const Tensor> w, std::span<const Tensor> dy,
                         std::span<const Tensor> dw, std::string_view role) override;
  Tensor row_forward(const Tensor& a, const Tensor& w, std::string_view role) override;
  Tensor row_backward(const Tensor& a, const Tensor& w, const Tensor& dy, const Tensor& dw,
                      std::string_view role) override;
  bool defer_weight_grads(WeightGradWork* work) override {
    deferred_ = work;
    return true;
  }

 protected:
  RingContext ring_;
  /// Runs `gemm`, or leaves it in deferred_ (stage 09's B/W split of the backward).
  void weight_grads(std::function<void()> gemm);

 private:
  WeightGradWork* deferred_ = nullptr;
};

/// The stage's factory: checks that N divides NH, F and S (ConfigError otherwise), then builds.
std::unique_ptr<Parallelism> make_overlap_ring(const RunContext& ctx);

}  // namespace tpx::ring
