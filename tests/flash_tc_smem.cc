// Prints, for each fused-attention kernel of common/cuda/flash_attention.cu, its threads per
// block and the dynamic shared memory its launcher gives it, one "name threads bytes" line each,
// for tests/check_flash_resources.py (ptxas reports registers, spills and static shared memory
// but not the dynamic bytes a launch asks for). The mma.sync kernels' bytes are
// flash_tc_math.h's, one line per instance (names as check_flash_resources.py writes them: no
// spaces, bf16 for __nv_bfloat16); the CUDA-core kernels' are their launchers' formulas, at
// D = 32 × the values per lane of the instantiation, for all of its instances.
#include <cstdio>
#include <initializer_list>

#include "common/cuda/flash_tc_math.h"

int main() {
  namespace tc = tpx::cuda::flash::tc;
  // Every instance: bf16 outputs (the bf16 tensors) and fp32 outputs (fp32 tensors under bf16
  // compute, chunk pairs), at each head dim.
  for (const char* out : {"bf16", "float"})
    for (int d : {32, 64, 128}) {
      std::printf("flash_forward_mma<%d,%s> %d %d\n", d, out, tc::kThreads, tc::forward_smem(d));
      std::printf("flash_bwd_mma<%d,%s> %d %d\n", d, out, tc::kThreads, tc::bwd_smem(d));
    }
  for (int per_lane : {1, 2, 4, 8}) {
    const int d = 32 * per_lane, tile = 32;
    std::printf("flash_forward_simple<%d> 128 %d\n", per_lane, 2 * tile * d * 4);
    std::printf("flash_dq_simple<%d> 128 %d\n", per_lane, 2 * tile * d * 4);
    std::printf("flash_dkdv_simple<%d> 128 %d\n", per_lane, (2 * tile * d + 2 * tile) * 4);
  }
  std::printf("flash_delta_kernel 256 0\nflash_merge_kernel 256 0\n");
  return 0;
}
