#include "config.h"

#include <fmt/format.h>

namespace tpx {

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
  if (c.steps < 1) errors.push_back(fmt::format("--steps must be at least 1 (got {})", c.steps));
  if (c.hidden > 0 && c.heads > 0 && c.hidden % c.heads != 0)
    errors.push_back(
        fmt::format("--hidden ({}) must be divisible by --heads ({})", c.hidden, c.heads));
  if (!(c.lr >= 0.0)) errors.push_back(fmt::format("--lr must be non-negative (got {})", c.lr));
  if (c.device == Device::cpu && c.dtype != DType::f32)
    errors.push_back(fmt::format("--dtype {} needs --device cuda; the cpu backend computes in fp32",
                                 to_string(c.dtype)));
  return errors;
}

}  // namespace tpx
