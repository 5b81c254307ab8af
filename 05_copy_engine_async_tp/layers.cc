#include "05_copy_engine_async_tp/layers.h"

#include "05_copy_engine_async_tp/copy_engine.h"
#include "05_copy_engine_async_tp/flags.h"

namespace tpx::async_tp {

std::unique_ptr<ChunkTransport> copy_engine_transport(const RunContext& ctx, TpGroup& group) {
  const CommOptions& comm = ctx.options.comm;
  const SymmetricOptions symmetric{.timeout_s = comm.timeout_s,
                                   .fault_rank = comm.signal_fault_rank,
                                   .fault_signal = comm.signal_fault,
                                   .delay_us = comm.copy_delay_us,
                                   .delay_seed = ctx.options.config.seed,
                                   .group = comm.group,
                                   .copy_fault_rank = comm.copy_fault_rank,
                                   .copy_fault = comm.copy_fault,
                                   .monitor = comm.monitor};
  const Device device = ctx.options.config.device;
  return std::make_unique<CopyEngineTransport>(
      group.rank(), group.world(), device, symmetric, group.trace(),
      ctx.options.flags<AllGatherFlags>().path() == AllGatherPath::nccl_zero_cta
          ? make_zero_cta_comm(comm, device)
          : nullptr);
}

std::unique_ptr<Parallelism> make_copy_engine_async_tp(const RunContext& ctx) {
  check_tp_split(ctx.options.config, ctx.world, /*sequence=*/true);
  return std::make_unique<CopyEngineAsyncTp>(ctx);  // checks the node (symmetric memory)
}

}  // namespace tpx::async_tp
