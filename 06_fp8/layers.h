// Stage 06: stage 05's schedule (ring-overlapped tensor + sequence parallelism, chunks moved by
// copy-engine pulls) with every GEMM of the seven linear layers in FP8 (DESIGN.md, "06 — FP8"):
//
//   forward  y  = x · W      E4M3 × E4M3
//   dgrad    dx = dy · Wᵀ    E5M2 × E4M3
//   wgrad    dW = xᵀ · dy    E4M3 × E5M2
//
// Per-tensor current scaling: each operand's amax is taken over the whole logical tensor, so the
// shards of a sharded tensor first agree on it with one MAX all-reduce (one per GEMM group, all of
// the group's operands in one small vector); scale = fmax / amax, q = cast(x · scale). Because
// every shard shares the scale, the column inputs are quantized on their [S/N, B, H] shard and the
// all-gathers move the FP8 bytes: ¼ of stage 05's. The reduce-scatters stay fp32. The FP8 copy of
// a column input is what backward keeps (¼ of the fp32 bytes), and each weight is quantized once
// per step, in forward, and reused by its backward.
//
// defines: tpx::async_fp8::Fp8AsyncTp, tpx::async_fp8::make_fp8_async_tp()
#pragma once

#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "05_copy_engine_async_tp/layers.h"

namespace tpx::async_fp8 {

class Fp8AsyncTp final : public ring::OverlapRing {
 public:
  explicit Fp8AsyncTp(const RunContext& ctx);

  ColumnResult column_forward(const Tensor& h, std::span<const Tensor> w,
                              std::string_view role) override;
  Tensor column_backward(const Tensor& saved, std::span<const Tensor> w, std::span<const Tensor> dy,
                         std::span<const Tensor> dw, std::string_view role) override;
  /// The FP8 shard of h under the forward's scale (selective recompute): the same codes.
  Tensor column_saved(const Tensor& h, const Tensor& scale) override;
  Tensor row_forward(const Tensor& a, const Tensor& w, std::string_view role) override;
  Tensor row_backward(const Tensor& a, const Tensor& w, const Tensor& dy, const Tensor& dw,
                      std::string_view role) override;
  /// fp8/layers.0.<name>(.scale): the layer-0 FP8 operands of the first forward, full size.
  std::vector<std::pair<std::string, Tensor>> dump_extra() override;

 private:
  /// x[i] in format[i], each with its own per-tensor scale, agreed over the group with one MAX
  /// all-reduce of the amaxes ("<what> amax" on the comm lane).
  std::vector<Tensor> quantize(std::span<const Tensor> x, std::span<const DType> format,
                               std::string_view what);
  /// The FP8 weight quantized by this step's forward (reused by its backward).
  const Tensor& fp8_weight(const Tensor& w) const;

  /// Keeps `q` as layer 0's `name` for dump_extra() if it is the first of that name.
  void keep_for_dump(const std::string& name, const Tensor& q);

  std::map<const void*, Tensor> weights_;  // by the address of the fp32 master weight
  std::map<std::string, Tensor> layer0_;   // the first forward's FP8 operands, by dump name
  bool keeping_ = true;                    // until dump_extra()
};

/// Stage 06 under --dtype fp8 (its default); stage 05 under fp32 or bf16.
std::unique_ptr<Parallelism> make_fp8_async_tp(const RunContext& ctx);

}  // namespace tpx::async_fp8
