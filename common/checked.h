// Size arithmetic that cannot overflow: element and byte counts of tensors and of the memory
// estimate are products of user-given sizes, so every product is checked (GCC/Clang's
// __builtin_mul_overflow) and an overflow is an error that says which count it was, never a
// wrapped number.
//
// defines: tpx::checked_mul(), tpx::checked_add(), tpx::checked_product(), tpx::SizeOverflow
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "check.h"

namespace tpx {

/// a · b, or nothing if it does not fit in T.
template <class T>
constexpr std::optional<T> checked_mul(T a, T b) {
  T r{};
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

/// a + b, or nothing if it does not fit in T.
template <class T>
constexpr std::optional<T> checked_add(T a, T b) {
  T r{};
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

/// The error of a count that does not fit: a config error to the stage (exit 2).
class SizeOverflow : public Error {
 public:
  using Error::Error;
};

/// The product of non-negative factors; throws SizeOverflow naming `what` (e.g. "S·B·H") if it
/// does not fit in int64.
inline std::int64_t checked_product(std::initializer_list<std::int64_t> factors,
                                    std::string_view what) {
  std::int64_t r = 1;
  for (const std::int64_t f : factors) {
    const auto next = checked_mul(r, f);
    if (!next)
      throw SizeOverflow(
          fmt::format("{} does not fit in a 64-bit count (the sizes are too large)", what));
    r = *next;
  }
  return r;
}

}  // namespace tpx
