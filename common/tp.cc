#include "tp.h"

#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "check.h"
#include "ops.h"

namespace tpx {

void check_tp_split(const BlockConfig& c, int world, bool sequence) {
  std::vector<std::string> problems;
  auto need = [&](const char* flag, std::int64_t value, const char* why) {
    if (value % world != 0)
      problems.push_back(
          fmt::format("--{} ({}) is not a multiple of {} ({})", flag, value, world, why));
  };
  const std::int64_t nkv = c.kv_heads_or_heads();
  if (nkv != c.heads) {
    // Grouped-query attention: a rank holds whole KV heads, each with its group of query heads.
    if (nkv % world != 0)
      problems.push_back(fmt::format(
          "--kv-heads ({}) is not a multiple of {} (whole KV heads per rank, each with its "
          "{} query heads; --heads is {})",
          nkv, world, c.heads / nkv, c.heads));
  } else {
    need("heads", c.heads, "whole heads per rank");
  }
  need("ffn", c.ffn, "F/N columns of Wg and Wu per rank");
  if (sequence) need("seq", c.seq, "S/N tokens per rank");
  if (!problems.empty())
    throw ConfigError(
        fmt::format("cannot split the block over {} ranks: {}", world, fmt::join(problems, "; ")));
}

StagePlan tp_plan(const RunContext& ctx, bool sequence, StageTraffic traffic) {
  const BlockConfig& c = ctx.options.config;
  check_tp_split(c, ctx.world, sequence);
  StagePlan p;
  p.sharding = {.rank = ctx.rank, .world = ctx.world, .weights = true, .sequence = sequence};
  p.traffic = traffic(c, ctx.world, 0);
  p.comm = fmt::format("tp over {} ranks (dry run)", ctx.world);
  return p;
}

TpGroup::TpGroup(const RunContext& ctx)
    : rank_(ctx.rank),
      world_(ctx.world),
      device_(ctx.options.config.device),
      trace_(ctx.trace),
      stream_(device_),
      comm_(make_communicator(ctx.options.comm, device_)) {
  TPX_CHECK(comm_->rank() == rank_ && comm_->size() == world_,
            "communicator is rank {} of {}, the job says {} of {}", comm_->rank(), comm_->size(),
            rank_, world_);
}

void TpGroup::all_reduce(const Tensor& t, std::string_view what) {
  TraceScope scope(trace_, std::string(what), Lane::comm);
  comm_->all_reduce(t, stream_);
}

void TpGroup::all_reduce_max(const Tensor& t, std::string_view what) {
  TraceScope scope(trace_, std::string(what), Lane::comm);
  comm_->all_reduce_max(t, stream_);
}

Tensor TpGroup::all_gather(const Tensor& local, std::string_view what) {
  auto shape = local.shape();
  shape[0] *= world_;
  Tensor full = Tensor::empty(shape, local.dtype(), local.device());
  TraceScope scope(trace_, std::string(what), Lane::comm);
  comm_->all_gather(local, full, stream_);
  return full;
}

Tensor TpGroup::reduce_scatter(const Tensor& full, std::string_view what) {
  auto shape = full.shape();
  TPX_CHECK(shape[0] % world_ == 0, "reduce-scatter of {} over {} ranks", full.describe(), world_);
  shape[0] /= world_;
  Tensor local = Tensor::empty(shape, full.dtype(), full.device());
  TraceScope scope(trace_, std::string(what), Lane::comm);
  comm_->reduce_scatter(full, local, stream_);
  return local;
}

ChunkTransport& TpGroup::adopt_transport(std::unique_ptr<ChunkTransport> transport) {
  TPX_CHECK(transport && !transport_, "a tensor-parallel group has one transport");
  transport_ = std::move(transport);
  return *transport_;
}

void TpGroup::bank_step_stats() {
  for (const CommStats& s :
       {comm_->take_stats(), transport_ ? transport_->take_stats() : CommStats{}}) {
    step_.payload_bytes += s.payload_bytes;
    step_.bus_bytes += s.bus_bytes;
    step_.calls += s.calls;
  }
}

CommStats TpGroup::take_stats() {
  bank_step_stats();
  const CommStats s = step_;
  step_ = {};
  return s;
}

double TpGroup::sum_for_report(double local) {
  bank_step_stats();
  // The communicator moves fp32. A double travels exactly as hi + lo; gathering every rank's pair
  // (instead of summing in fp32) lets each rank add them in double, in rank order, so all ranks
  // get the same sum to double precision.
  const auto hi = static_cast<float>(local);
  const auto lo = static_cast<float>(local - double(hi));
  Tensor mine = Tensor::empty({1, 2});
  mine.f32()[0] = hi;
  mine.f32()[1] = lo;
  Tensor all = Tensor::empty({world_, 2}, DType::f32, device_);
  {
    TraceScope scope(trace_, "all-gather (report scalar)", Lane::comm, /*counted=*/false);
    comm_->all_gather(ops::to_device(mine, device_), all, stream_);
  }
  drop_report_stats();
  const Tensor host = ops::to_device(all, Device::cpu);
  double sum = 0.0;
  for (const float v : host.f32()) sum += double(v);
  return sum;
}

Tensor TpGroup::gather_param(Param p, const Tensor& local) {
  return gather_split(param_split(p), local);
}

Tensor TpGroup::gather_split(Split split, const Tensor& local) {
  if (split == Split::replicated || world_ == 1) return local;
  bank_step_stats();
  Tensor stacked = all_gather(local, "all-gather (snapshot)");  // [N·rows, cols]
  drop_report_stats();
  if (split == Split::rows) return stacked;
  // Rank r's block [in, out/N] is rows [r·in, (r+1)·in) of `stacked`; it belongs in columns
  // [r·out/N, (r+1)·out/N) of the full [in, out].
  // (Byte-wise, so FP8 shards interleave too; the result is on the host.)
  const Tensor host = ops::to_device(stacked, Device::cpu);
  const std::int64_t in = local.dim(0), cols = local.dim(1);
  const auto e = static_cast<std::int64_t>(dtype_size(local.dtype()));
  Tensor full = Tensor::empty({in, cols * world_}, local.dtype());
  const auto* src = static_cast<const std::byte*>(host.raw());
  auto* dst = static_cast<std::byte*>(full.raw());
  for (std::int64_t r = 0; r < world_; ++r)
    for (std::int64_t i = 0; i < in; ++i)
      std::memcpy(dst + (i * cols * world_ + r * cols) * e, src + (r * in + i) * cols * e,
                  static_cast<std::size_t>(cols * e));
  if (local.scale().defined()) full = full.with_scale(ops::to_device(local.scale(), Device::cpu));
  return full;
}

Tensor TpGroup::gather_sequence(const Tensor& local) {
  bank_step_stats();
  Tensor full = all_gather(local, "all-gather (snapshot)");
  drop_report_stats();
  return full;
}

}  // namespace tpx
