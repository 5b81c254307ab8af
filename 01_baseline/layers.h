// Stage 01's linear layers: plain y = x·W on one device, no communication. Later stages link this
// to run stage 01 in-process as the reference of their --check.
//
// defines: tpx::baseline::SerialLinears, tpx::baseline::run_reference()
#pragma once

#include <span>

#include "common/parallel.h"
#include "common/reference.h"

namespace tpx::baseline {

class SerialLinears final : public Parallelism {
 public:
  /// `compute` is the GEMM operand type (--dtype): fp32, or bf16 with fp32 accumulation.
  explicit SerialLinears(DType compute = DType::f32) : compute_(compute) {}
  Sharding sharding() const override { return {}; }
  ColumnResult column_forward(const Tensor& h, std::span<const Tensor> w,
                              std::string_view role) override;
  Tensor column_backward(const Tensor& h, std::span<const Tensor> w, std::span<const Tensor> dy,
                         std::span<const Tensor> dw, std::string_view role) override;
  Tensor row_forward(const Tensor& a, const Tensor& w, std::string_view role) override;
  Tensor row_backward(const Tensor& a, const Tensor& w, const Tensor& dy, const Tensor& dw,
                      std::string_view role) override;

 private:
  DType compute_;
};

/// Stage 01 run in-process for `steps` steps, as a reference for the distributed stages.
ReferenceRun run_reference(const BlockConfig& c, int steps);

}  // namespace tpx::baseline
