#include "05_copy_engine_async_tp/layers.h"

namespace tpx::async_tp {

std::unique_ptr<Parallelism> make_copy_engine_async_tp(const RunContext& ctx) {
  check_tp_split(ctx.options.config, ctx.world, /*sequence=*/true);
  return std::make_unique<CopyEngineAsyncTp>(ctx);  // checks the node (symmetric memory)
}

}  // namespace tpx::async_tp
