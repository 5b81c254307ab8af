#include "config.h"

#include <limits>

#include <fmt/format.h>

#include "checked.h"

namespace tpx {

std::string_view dtype_flag(DType d) {
  return is_fp8(d) ? "fp8" : to_string(d);
}

std::vector<std::string> validate(const BlockConfig& c) {
  std::vector<std::string> errors;
  auto positive = [&](const char* flag, std::int64_t v) {
    if (v <= 0) errors.push_back(fmt::format("--{} must be positive (got {})", flag, v));
  };
  positive("hidden", c.hidden);
  positive("heads", c.heads);
  positive("ffn", c.ffn);
  positive("seq", c.seq);
  positive("batch", c.batch);
  positive("layers", c.layers);
  if (c.lm() && (c.vocab < kMinVocab || c.vocab > kMaxVocab))
    errors.push_back(
        fmt::format("--vocab must be between {} and {} (got {})", kMinVocab, kMaxVocab, c.vocab));
  if (c.eval_every < 0)
    errors.push_back(fmt::format("--eval-every must be >= 0 (got {}; 0: never)", c.eval_every));
  if (c.steps < 1) errors.push_back(fmt::format("--steps must be at least 1 (got {})", c.steps));
  if (c.steps > std::numeric_limits<int>::max())
    errors.push_back(fmt::format("--steps must be at most {} (got {})",
                                 std::numeric_limits<int>::max(), c.steps));
  if (c.hidden > 0 && c.heads > 0 && c.hidden % c.heads != 0)
    errors.push_back(
        fmt::format("--hidden ({}) must be divisible by --heads ({})", c.hidden, c.heads));
  if (c.kv_heads < 0)
    errors.push_back(fmt::format("--kv-heads must be positive (got {})", c.kv_heads));
  else if (c.heads > 0 && c.kv_heads > 0 && c.heads % c.kv_heads != 0)
    errors.push_back(
        fmt::format("--kv-heads ({}) must divide --heads ({}): each KV head serves a whole group "
                    "of query heads",
                    c.kv_heads, c.heads));
  if (!(c.rope_theta >= 0.0))
    errors.push_back(
        fmt::format("--rope-theta must be non-negative (got {}; 0 turns RoPE off)", c.rope_theta));
  else if (c.rope_theta > 0 && c.hidden > 0 && c.heads > 0 && c.hidden % c.heads == 0 &&
           c.head_dim() % 2 != 0)
    errors.push_back(fmt::format(
        "the rotary embedding rotates pairs of a head's elements, so the head dim H/NH must be "
        "even (got {}); use --rope-theta 0 to run without it",
        c.head_dim()));
  if (c.recompute_every < 1 || (c.layers > 0 && c.recompute_every > c.layers))
    errors.push_back(fmt::format(
        "--recompute-every must be 1 … --layers ({}) (got {}): layer l is recomputed when "
        "l % K == 0",
        c.layers, c.recompute_every));
  if (!(c.beta1 >= 0.0 && c.beta1 < 1.0))
    errors.push_back(fmt::format("--beta1 must be in [0, 1) (got {})", c.beta1));
  if (!(c.beta2 >= 0.0 && c.beta2 < 1.0))
    errors.push_back(fmt::format("--beta2 must be in [0, 1) (got {})", c.beta2));
  if (!(c.eps > 0.0)) errors.push_back(fmt::format("--eps must be positive (got {})", c.eps));
  if (!(c.weight_decay >= 0.0))
    errors.push_back(fmt::format("--weight-decay must be non-negative (got {})", c.weight_decay));
  if (!(c.lr >= 0.0)) errors.push_back(fmt::format("--lr must be non-negative (got {})", c.lr));
  if (c.dtype == DType::e5m2)
    errors.push_back("--dtype names the forward format; fp8 means E4M3 forward, E5M2 backward");
  if (!errors.empty()) return errors;

  // The largest tensors' byte counts must fit in 64 bits, or element counts, offsets and
  // allocations would wrap. (Whether they fit in memory is the memory check's question.)
  auto fits = [&](std::initializer_list<std::int64_t> factors, const char* what) {
    try {
      checked_product(factors, what);
    } catch (const SizeOverflow&) {
      errors.push_back(fmt::format("the sizes are too large: {} does not fit in 64 bits", what));
    }
  };
  constexpr std::int64_t kMaxElementBytes = 4;  // fp32
  fits({c.seq, c.batch, c.hidden, kMaxElementBytes}, "an activation's bytes (S·B·H·4)");
  fits({c.seq, c.batch, c.ffn, kMaxElementBytes}, "an MLP activation's bytes (S·B·F·4)");
  fits({c.batch, c.heads, c.seq, c.seq, kMaxElementBytes},
       "the attention probabilities' bytes (B·NH·S·S·4)");
  fits({c.hidden, c.ffn, kMaxElementBytes}, "an MLP weight's bytes (H·F·4)");
  fits({c.hidden, c.hidden, kMaxElementBytes}, "an attention weight's bytes (H·H·4)");
  return errors;
}

}  // namespace tpx
