// The CPU backend: fp32 on host memory, GEMMs through CBLAS (OpenBLAS).
// Signatures mirror tpx::ops (common/ops.h), which dispatches here for cpu tensors.
#pragma once

#include <cstdint>

#include "../lowp_block.h"
#include "../ops.h"
#include "../tensor.h"
#include "host.h"

namespace tpx::cpu {

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
          float alpha, float beta);
void rmsnorm_forward(const Tensor& x, const Tensor& g, const Tensor& y, const Tensor& rstd);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dg);
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                       const Tensor& out, const Tensor& probs);
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& probs, std::int64_t heads, const Tensor& dq, const Tensor& dk,
                        const Tensor& dv);
// Fused (FlashAttention-2) attention, attention.cc: no probabilities, only lse [B, heads, S].
void attention_fused_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                             const Tensor& out, const Tensor& lse);
void attention_fused_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, std::int64_t heads,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv);
// Context parallelism's chunk pairs and their log-sum-exp merge (attention.cc).
void attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                             const Tensor& out, const Tensor& lse, std::int64_t shift);
void attention_block_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, std::int64_t heads,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              std::int64_t shift);
void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& part_out,
                     const Tensor& part_lse, std::int64_t heads);
// Rotary embedding, in place (cos/sin tables in double, rounded to fp32).
void rope_forward(const Tensor& x, std::int64_t heads, double theta, std::int64_t first);
void rope_backward(const Tensor& dx, std::int64_t heads, double theta, std::int64_t first);
void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& out);
void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, const Tensor& dgate,
                     const Tensor& dup);
void add(const Tensor& a, const Tensor& b, const Tensor& out);
void accumulate(const Tensor& x, const Tensor& into);
double mse_loss_sum(const Tensor& y, const Tensor& t);
void mse_loss_backward(const Tensor& y, const Tensor& t, double scale, const Tensor& dy);
void sgd_update(const Tensor& w, const Tensor& grad, float lr, const Tensor& copy);
// The language model's ends (lm.cc): the vocabulary-parallel embedding and cross-entropy, on
// f32 tensors (tpx::ops checks the shapes and gives bf16 tensors fp32 stand-ins, on the cpu).
void embedding_forward(const Tensor& ids, const Tensor& table, std::int64_t begin,
                       const Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& dout, std::int64_t begin,
                        const Tensor& dtable);
void cross_entropy_partial(const Tensor& logits, const Tensor& targets, std::int64_t begin,
                           std::int64_t vocab, const Tensor& max, const Tensor& sumexp,
                           const Tensor& target_logit);
void cross_entropy_rescale(const Tensor& local_max, const Tensor& max, const Tensor& sumexp);
double cross_entropy_loss(const Tensor& max, const Tensor& sumexp, const Tensor& target_logit,
                          const Tensor& lse);
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            std::int64_t begin, std::int64_t vocab, double scale,
                            const Tensor& dlogits);
void adamw_update(const Tensor& w, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const ops::AdamWStep& s, const Tensor& copy);
double sum_squares(const Tensor& x);
std::vector<double> sum_squares_each(const std::vector<Tensor>& xs);
void fill(const Tensor& t, float value);

// FP8 casts (fp8_ops.cc); arguments checked by tpx::ops.
void quantize_fp8(const Tensor& x, const Tensor& scale, const Tensor& q);
void dequantize_fp8(const Tensor& q, const Tensor& scale, const Tensor& x);
void amax(const Tensor& x, const Tensor& out);
void fp8_scale(const Tensor& amax, DType fmt, const Tensor& scale);
// Low-precision recipes (lowp_ops.cc); arguments checked by tpx::ops. x, codes and y as matrices
// [rows, cols] (cols the last dimension).
void lowp_quantize(const Tensor& x, lowp::Recipe recipe, lowp::Operand operand,
                   std::optional<float> tensor_amax, const Tensor& codes, const Tensor& scales,
                   const Tensor& tensor_scale, const lowp::StochasticRounding* stochastic);
void lowp_dequantize(const Tensor& codes, const lowp::Layout& l, const Tensor& scales,
                     const Tensor& tensor_scale, const Tensor& x, bool transpose);
void transpose(const Tensor& x, std::int64_t rows, std::int64_t cols, const Tensor& out);
void hadamard_rows(const Tensor& x, std::int64_t rows, std::int64_t cols, const Tensor& y);
void pack_e2m1(const Tensor& codes, const Tensor& packed);
void unpack_e2m1(const Tensor& packed, const Tensor& codes);

// Mixture of experts (moe_ops.cc); arguments checked by tpx::ops.
void moe_route(const Tensor& logits, const Tensor& bias, bool sigmoid, const Tensor& score,
               const Tensor& expert, const Tensor& weight);
void gather_rows(const Tensor& x, const Tensor& index, const Tensor& scale, const Tensor& out);
void combine_rows(const Tensor& rows, const Tensor& slot, const Tensor& weight, const Tensor& out,
                  bool accumulate);
void rows_dot(const Tensor& a, const Tensor& rows, const Tensor& slot, const Tensor& out);
void moe_router_dz(const Tensor& score, const Tensor& expert, const Tensor& weight,
                   const Tensor& dweight, const Tensor& dP, bool sigmoid, std::int64_t tokens_all,
                   const Tensor& dz);

}  // namespace tpx::cpu
