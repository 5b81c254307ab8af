// The FP8 GEMM's operand preparation (gemm_fp8.cc): copying FP8 codes into the K-major, padded
// layout cuBLASLt's FP8 kernels read, transposing on the way where the caller's layout is the
// other one; and the inverted scales cuBLASLt multiplies by.
//
// Shape of the pack: a classic tiled transpose. A block of 32 x 8 threads moves a 32 x 32 tile of
// codes through shared memory: it reads rows of the source (32 consecutive bytes per warp) and
// writes rows of the output, so both global accesses are coalesced whichever way the tile turns.
// Each thread handles 4 of the tile's 32 rows. The shared tile's rows are 36 bytes apart: reading
// a column touches the words 9·x (mod 32) for lanes x = 0..31, all different banks. Padding
// positions (beyond the matrix, up to the output's size) are written as code 0x00, +0. Which
// operand is packed, and to what size, is common/fp8_gemm_plan.h's decision.
//
// The block-scaled GEMMs (gemm_scaled.cc) need more than one factor per operand: scale_factors
// writes the reciprocal of every block scale where cuBLASLt's scale tensor keeps it
// (common/scaled_gemm_plan.h, arrangement()), one thread per scale; the caller zeroes the padding.
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"
#include "common/fp8_bits.h"
#include "kernels.h"

namespace tpx::cuda::kernels {
namespace {

using dev::I;

constexpr int kTile = 32, kRows = 8;  // a tile is kTile x kTile codes; a block kTile x kRows
constexpr int kThreads = kTile * kRows;
constexpr int kPitch = kTile + 4;  // shared row pitch in bytes, see the header

template <bool Transposed>
__global__ void __launch_bounds__(kThreads)
    pack_kernel(const std::uint8_t* src, I ld, I rows, I cols, std::uint8_t* out, I out_rows,
                I out_cols, I tiles_across, I tiles) {
  __shared__ std::uint8_t tile[kTile][kPitch];
  const int x = threadIdx.x;
  for (I t = blockIdx.x; t < tiles; t += gridDim.x) {
    const I r0 = t / tiles_across * kTile, c0 = t % tiles_across * kTile;
    for (int y = threadIdx.y; y < kTile; y += kRows) {
      if constexpr (Transposed) {
        // M[r0 + x][c0 + y] = src[(c0 + y)·ld + r0 + x]: a row of the source, kept untransposed.
        const I r = r0 + x, c = c0 + y;
        tile[y][x] = r < rows && c < cols ? src[c * ld + r] : std::uint8_t{0};
      } else {
        const I r = r0 + y, c = c0 + x;
        tile[y][x] = r < rows && c < cols ? src[r * ld + c] : std::uint8_t{0};
      }
    }
    __syncthreads();
    for (int y = threadIdx.y; y < kTile; y += kRows) {
      const I r = r0 + y, c = c0 + x;
      if (r < out_rows && c < out_cols)
        out[r * out_cols + c] = Transposed ? tile[x][y] : tile[y][x];
    }
    __syncthreads();  // the tile is refilled by the next iteration
  }
}

// fp8::div_rn: the correctly rounded quotient whatever -use_fast_math or -prec-div say.
__global__ void scale_inverses_kernel(const float* scale_a, const float* scale_b, float* inv_a,
                                      float* inv_b) {
  *inv_a = fp8::div_rn(1.0f, *scale_a);
  *inv_b = fp8::div_rn(1.0f, *scale_b);
}

constexpr int kFactorThreads = 256;

// out[r·row_stride + c·col_stride] = 1 / scales[r·cols + c], correctly rounded (fp8::div_rn).
__global__ void __launch_bounds__(kFactorThreads)
    scale_factors_kernel(const float* scales, I rows, I cols, I row_stride, I col_stride,
                         float* out) {
  const I n = rows * cols;
  for (I i = blockIdx.x * I(blockDim.x) + threadIdx.x; i < n; i += I(gridDim.x) * blockDim.x) {
    const I r = i / cols, c = i % cols;
    out[r * row_stride + c * col_stride] = fp8::div_rn(1.0f, scales[i]);
  }
}

}  // namespace

void pack_fp8(const std::uint8_t* src, I ld, bool transposed, I rows, I cols, std::uint8_t* out,
              I out_rows, I out_cols, void* stream) {
  if (out_rows == 0 || out_cols == 0) return;
  const I across = (out_cols + kTile - 1) / kTile;
  const I tiles = (out_rows + kTile - 1) / kTile * across;
  const dim3 block(kTile, kRows);
  const unsigned grid = dev::blocks_for(tiles * kThreads, kThreads);
  if (transposed)
    pack_kernel<true><<<grid, block, 0, dev::as_stream(stream)>>>(
        src, ld, rows, cols, out, out_rows, out_cols, across, tiles);
  else
    pack_kernel<false><<<grid, block, 0, dev::as_stream(stream)>>>(
        src, ld, rows, cols, out, out_rows, out_cols, across, tiles);
}

void fp8_scale_inverses(const float* scale_a, const float* scale_b, float* inv_a, float* inv_b,
                        void* stream) {
  scale_inverses_kernel<<<1, 1, 0, dev::as_stream(stream)>>>(scale_a, scale_b, inv_a, inv_b);
}

void scale_factors(const float* scales, I rows, I cols, I row_stride, I col_stride, float* out,
                   void* stream) {
  if (rows * cols == 0) return;
  scale_factors_kernel<<<dev::blocks_for(rows * cols, kFactorThreads), kFactorThreads, 0,
                         dev::as_stream(stream)>>>(scales, rows, cols, row_stride, col_stride, out);
}

}  // namespace tpx::cuda::kernels
