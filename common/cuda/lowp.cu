// The low-precision recipes' quantizer on the device (common/lowp.h), block by block, with the
// functions the cpu quantizer calls (common/lowp_block.h): one thread block per scale block (a
// grid-stride loop over them) reduces the block's amax, takes its scale from lowp::block_scale and
// casts every element with lowp::cast_element, so both backends write the same bytes. The amax
// follows lowp::block_amax: a NaN anywhere makes it NaN, otherwise max |x| (+inf included); max is
// exact in any order, so the reduction's order changes nothing. nvfp4's tensor scale s_enc is
// made on the device from the tensor amax the caller passes (the whole tensor's, or the one its
// shards agreed), so nothing waits for the host.
//
// Shape: 256 threads a block; a 1 × 16 (nvfp4) or 1 × 32 (mxfp8) block leaves most of them idle,
// a 128 × 128 weight block or a rowwise row of K keeps them busy. This is the reference cast on
// the GPU, for the tests and the recipes' dequantize-then-multiply path, not a tuned kernel.
// Resources (ptxas, sm_90): the quantizer 44 registers, 2 KiB of shared memory, no spills and no
// stack (the stochastic rounding's bits travel by value; so 5 blocks of 256 threads per SM: 44
// registers round up to 48 a thread); the dequantizer 32 registers, no spills.
// lowp_dequantize is element-wise: each element looks up its block's scale and calls
// lowp::decode_element, as lowp::dequantize does. Beside them, the moves stage 06's recipes need
// on the device: nvfp4's Hadamard transform (32 registers) and E2M1 packing (28), element-wise.
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"
#include "common/fp8_bits.h"
#include "common/lowp_block.h"
#include "kernels.h"

namespace tpx::cuda::kernels {
namespace {

using dev::I;

constexpr int kThreads = 256;

/// Scale block `blk`'s rectangle [r0, r1) × [c0, c1).
struct Box {
  I r0, r1, c0, c1;
};
__device__ Box box_of(I blk, I rows, I cols, I br, I bc, I scale_cols) {
  const I sr = blk / scale_cols, sc = blk % scale_cols;
  const I r0 = sr * br, c0 = sc * bc;
  return {r0, r0 + br < rows ? r0 + br : rows, c0, c0 + bc < cols ? c0 + bc : cols};
}

__global__ void __launch_bounds__(kThreads)
    lowp_quantize_kernel(const float* x, I rows, I cols, lowp::Layout l, I br, I bc, I scale_cols,
                         I blocks, const float* tensor_amax, bool stochastic,
                         lowp::StochasticRounding sr, std::uint8_t* codes, float* scales,
                         std::uint8_t* scale_codes, float* tensor_scale) {
  __shared__ float block_max[kThreads];
  __shared__ int block_nan[kThreads];
  // nvfp4's s_enc, the same in every block.
  const float s_enc = tensor_amax != nullptr ? lowp::nvfp4_tensor_scale(*tensor_amax) : 1.0f;
  if (tensor_scale != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *tensor_scale = s_enc;
  for (I blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const Box b = box_of(blk, rows, cols, br, bc, scale_cols);
    const I width = b.c1 - b.c0, n = (b.r1 - b.r0) * width;
    float m = 0.0f;
    int nan = 0;
    for (I e = threadIdx.x; e < n; e += kThreads) {
      const float v = x[(b.r0 + e / width) * cols + b.c0 + e % width];
      if (fp8::is_nan(v)) {
        nan = 1;
      } else {
        m = fmaxf(m, fabsf(v));
      }
    }
    block_max[threadIdx.x] = m;
    block_nan[threadIdx.x] = nan;
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half /= 2) {
      if (int(threadIdx.x) < half) {
        block_max[threadIdx.x] = fmaxf(block_max[threadIdx.x], block_max[threadIdx.x + half]);
        block_nan[threadIdx.x] |= block_nan[threadIdx.x + half];
      }
      __syncthreads();
    }
    const float amax = block_nan[0] != 0 ? fp8::bits_float(fp8::kNaNBits) : block_max[0];
    const lowp::BlockScale s = lowp::block_scale(amax, l, s_enc);
    if (threadIdx.x == 0) {
      if (l.scale == lowp::ScaleFormat::fp32) {
        scales[blk] = s.scale;
      } else {
        scale_codes[blk] = s.code;
      }
    }
    for (I e = threadIdx.x; e < n; e += kThreads) {
      const I r = b.r0 + e / width, c = b.c0 + e % width, i = r * cols + c;
      const std::uint32_t bits = stochastic ? lowp::sr_bits(sr, r, c) : 0u;
      codes[i] = lowp::cast_element(x[i], l, s, s_enc, stochastic, bits);
    }
    __syncthreads();  // block_max and block_nan are read above before the next block's writes
  }
}

__global__ void __launch_bounds__(kThreads)
    lowp_dequantize_kernel(const std::uint8_t* codes, I rows, I cols, lowp::Layout l, I br, I bc,
                           I scale_cols, const float* scales, const std::uint8_t* scale_codes,
                           const float* tensor_scale, float* x, bool transpose) {
  const float s_enc = tensor_scale != nullptr ? *tensor_scale : 1.0f;
  const I n = rows * cols, stride = I(gridDim.x) * kThreads;
  for (I i = I(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const I blk = (i / cols / br) * scale_cols + (i % cols) / bc;
    const lowp::BlockScale b = l.scale == lowp::ScaleFormat::fp32
                                   ? lowp::BlockScale{scales[blk], 0}
                                   : lowp::BlockScale{1.0f, scale_codes[blk]};
    x[transpose ? (i % cols) * rows + i / cols : i] = lowp::decode_element(codes[i], l, b, s_enc);
  }
}

/// y = R·x on every whole group of 16 rows (lowp::hadamard_rows): one thread an element, its sum of
/// 16 products in row order, each product and sum rounded on its own (R's entries are ±1/4, so the
/// product is exact but for underflow; no fused multiply-add, as the cpu computes it).
__global__ void __launch_bounds__(kThreads)
    hadamard_rows_kernel(const float* x, I rows, I cols, float* y) {
  const I n = rows * cols, stride = I(gridDim.x) * kThreads, whole = rows / lowp::kRhtSize;
  for (I e = I(blockIdx.x) * kThreads + threadIdx.x; e < n; e += stride) {
    const I r = e / cols, c = e % cols, g = r / lowp::kRhtSize;
    if (g >= whole) {  // a last group of fewer than 16 rows stays as it is
      y[e] = x[e];
      continue;
    }
    const int i = int(r % lowp::kRhtSize);
    const float* col = x + g * lowp::kRhtSize * cols + c;
    float sum = 0.0f;
    for (int j = 0; j < lowp::kRhtSize; ++j) {
      const float rij = lowp::rht_entry(i, j);
      sum = __fadd_rn(sum, __fmul_rn(rij, col[j * cols]));
    }
    y[e] = sum;
  }
}

__global__ void __launch_bounds__(kThreads)
    e2m1_pack_kernel(std::uint8_t* codes, I bytes, std::uint8_t* packed, bool pack) {
  const I stride = I(gridDim.x) * kThreads;
  for (I i = I(blockIdx.x) * kThreads + threadIdx.x; i < bytes; i += stride) {
    if (pack) {
      packed[i] = std::uint8_t((codes[2 * i] & 0x0Fu) | ((codes[2 * i + 1] & 0x0Fu) << 4));
    } else {
      const std::uint8_t b = packed[i];
      codes[2 * i] = b & 0x0Fu;
      codes[2 * i + 1] = std::uint8_t(b >> 4);
    }
  }
}

unsigned grid_for(I n) {
  const I want = (n + kThreads - 1) / kThreads;
  return unsigned(want < I{65535} ? want : I{65535});
}

}  // namespace

void hadamard_rows(const float* x, I rows, I cols, float* y, void* stream) {
  hadamard_rows_kernel<<<grid_for(rows * cols), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, rows, cols, y);
}

void e2m1_pack(std::uint8_t* codes, I bytes, std::uint8_t* packed, bool pack, void* stream) {
  e2m1_pack_kernel<<<grid_for(bytes), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      codes, bytes, packed, pack);
}

void lowp_dequantize(const std::uint8_t* codes, I rows, I cols, const lowp::Layout& l,
                     const float* scales, const std::uint8_t* scale_codes,
                     const float* tensor_scale, float* x, bool transpose, void* stream) {
  const I br = l.block_rows == 0 ? rows : l.block_rows;
  const I bc = l.block_cols == 0 ? cols : l.block_cols;
  const I scale_cols = (cols + bc - 1) / bc;
  const I want = (rows * cols + kThreads - 1) / kThreads;
  const I grid = want < I{65535} ? want : I{65535};
  lowp_dequantize_kernel<<<unsigned(grid), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      codes, rows, cols, l, br, bc, scale_cols, scales, scale_codes, tensor_scale, x, transpose);
}

void lowp_quantize(const float* x, I rows, I cols, const lowp::Layout& l, const float* tensor_amax,
                   const lowp::StochasticRounding* stochastic, std::uint8_t* codes, float* scales,
                   std::uint8_t* scale_codes, float* tensor_scale, void* stream) {
  const I br = l.block_rows == 0 ? rows : l.block_rows;
  const I bc = l.block_cols == 0 ? cols : l.block_cols;
  const I scale_rows = (rows + br - 1) / br, scale_cols = (cols + bc - 1) / bc;
  const I blocks = scale_rows * scale_cols;
  const I grid = blocks < I{65535} ? blocks : I{65535};
  lowp_quantize_kernel<<<unsigned(grid), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x, rows, cols, l, br, bc, scale_cols, blocks, tensor_amax, stochastic != nullptr,
      stochastic != nullptr ? *stochastic : lowp::StochasticRounding{}, codes, scales, scale_codes,
      tensor_scale);
}

}  // namespace tpx::cuda::kernels
