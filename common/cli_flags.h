// What a stage's flag group (cli.h's FlagGroup) registers its flags with: CLI11, and numeric
// flags that parse all of their text or fail with a message naming the flag.
//
// defines: tpx::parse_number(), tpx::add_number(), tpx::add_count(), tpx::add_mesh_degree()
#pragma once

#include <charconv>
#include <cmath>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "cli.h"

namespace tpx {

/// `text` as a T, all of it: decimal digits (a leading '-' only for signed types; a float may
/// also have a fraction and an exponent), in T's range, finite. Anything else is an error naming
/// the flag: an empty value, "12abc", "-1" for an unsigned seed, 2^64 for an int64 size, "nan".
template <class T>
T parse_number(std::string_view flag, const std::string& text) {
  T value{};
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  auto error = [&](std::string_view why) {
    return CLI::ValidationError(fmt::format("{} '{}': {}", flag, text, why));
  };
  if (text.empty()) throw error("empty value");
  if (ec == std::errc::result_out_of_range) {
    if constexpr (std::is_integral_v<T>)
      throw error(fmt::format("out of range ({} to {})", std::numeric_limits<T>::min(),
                              std::numeric_limits<T>::max()));
    else
      throw error("out of range");
  }
  if (ec != std::errc() || ptr != end)
    throw error(std::is_integral_v<T>
                    ? (std::is_signed_v<T> ? "not an integer" : "not a non-negative integer")
                    : "not a number");
  if constexpr (std::is_floating_point_v<T>)
    if (!std::isfinite(value)) throw error("not a finite number");
  return value;
}

/// Registers a numeric flag parsed by parse_number (CLI11's own conversion caps out-of-range
/// values and wraps negative unsigned ones); --help shows the default.
template <class T>
CLI::Option* add_number(CLI::App& app, const std::string& flag, T& target,
                        const std::string& help) {
  return app
      .add_option_function<std::string>(
          flag, [&target, flag](const std::string& s) { target = parse_number<T>(flag, s); }, help)
      ->default_str(fmt::format("{}", target))
      ->type_name(std::is_integral_v<T> ? "INT" : "FLOAT");
}

/// Registers a count that must be positive when given, parsed by parse_number. Its variable's 0
/// (or other default) stands for "not given", so a 0 or a negative value the user typed is
/// refused, never taken for the default: `when_not_given` says what the flag takes when it is
/// left out ("2 if the ranks are even, else 1").
inline CLI::Option* add_count(CLI::App& app, const std::string& flag, int& target,
                              const std::string& help, const std::string& when_not_given) {
  return app
      .add_option_function<std::string>(
          flag,
          [&target, flag, when_not_given](const std::string& s) {
            const int value = parse_number<int>(flag, s);
            if (value < 1)
              throw CLI::ValidationError(
                  fmt::format("{} '{}': must be a positive number (leave {} out for {})", flag, s,
                              flag, when_not_given));
            target = value;
          },
          help)
      // A 0 stands for the default the help words: shown as no value at all, not as "=0".
      ->default_str(target == 0 ? std::string() : fmt::format("{}", target))
      ->type_name("INT");
}

/// Registers a mesh degree (--dp, --cp, --pp of stages 07-09), named `letter` in --help, whose
/// help ends with the default the running stage takes when the flag is not given
/// (mesh_default_words: `newest` is the stage's newest mesh dimension). A given degree is
/// positive (add_count): 0 is not the default's spelling.
inline CLI::Option* add_mesh_degree(CLI::App& app, const std::string& flag, int& target,
                                    const std::string& letter, const std::string& help,
                                    MeshFlag dim, MeshFlag newest, const std::string& group) {
  const std::string fallback = mesh_default_words(newest, dim);
  return add_count(app, flag, target, help + "; when not given, " + fallback,
                   "its default: " + fallback)
      ->type_name(letter)
      ->group(group);
}

}  // namespace tpx
