// The values the fused attention kernels (flash_attention.cu) compute with, as functions that run
// on the host as well, so that a test without a GPU can check the rules the kernels follow.
//
// Under bf16 compute every operand of a product is rounded to bf16 as it is read. Backward needs
// Δ_i = Σ_j P_ij·dP_ij with dP_ij = dO_i·v_j; it computes Δ_i = Σ_d dO_id·O_id instead, which is
// the same sum only if dO is read the same way in both: Σ_j P_ij (dO_i·v_j) = dO_i·(Σ_j P_ij v_j)
// = dO_i·O_i. So Δ reads dO through operand() too (delta_term), and O as the forward wrote it.
// Read unrounded, Δ differs from Σ_j P·dP by Σ_d (dO − bf16(dO))·O, about 2⁻⁹·|dO|·|O|·sqrt(D):
// every dS = P·(dP − Δ) is then off by that much, and where dQ and dK are zero (one query row,
// S = 1: the softmax of one score is constant) they come out as that error times K and Q.
//
// defines: tpx::cuda::flash::round_bf16, operand, delta_term
#pragma once

#include "common/host_device.h"

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#endif

namespace tpx::cuda::flash {

/// x rounded to the nearest bf16 (ties to even) and widened back: on the device
/// __float2bfloat16_rn, on the host the same rounding on the bits (NaN stays NaN).
TPX_HD inline float round_bf16(float x) {
#if defined(__CUDA_ARCH__)
  return __bfloat162float(__float2bfloat16_rn(x));
#else
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    u |= 0x00400000u;  // NaN: quiet, sign and top payload kept
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);  // ties go to the even neighbour
  }
  u &= 0xffff0000u;
  float r;
  std::memcpy(&r, &u, sizeof r);
  return r;
#endif
}

/// x as a product's operand: itself, or rounded to bf16 under bf16 compute.
template <bool kBf16>
TPX_HD inline float operand(float x) {
  if constexpr (kBf16) return round_bf16(x);
  return x;
}

/// One term of Δ_i = Σ_d dO_id·O_id: dO read as the dP = dO·Vᵀ products read it, O as the
/// forward stored it (the P-weighted sum of rounded V rows; in a bf16 tensor, rounded once).
template <bool kBf16>
TPX_HD inline float delta_term(float dout, float out) {
  return operand<kBf16>(dout) * out;
}

}  // namespace tpx::cuda::flash
