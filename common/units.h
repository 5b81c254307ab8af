// Byte counts as a person reads them: binary units (B, KiB, MiB, GiB, TiB, PiB, EiB), one
// spelling each, everywhere a table or a header shows bytes (raw counts stay in --json and CSV).
// Header-only, so that the tools that do not link tpx_common (tpx_report, tpx_project) use the
// same words.
//
// defines: tpx::ByteUnit, tpx::byte_unit(), tpx::bytes_text()
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace tpx {

/// The binary unit a byte count is best read in, and the decimals it is shown with.
struct ByteUnit {
  std::string_view name;  ///< "B", "KiB", ..., "EiB"
  double scale;           ///< bytes per unit
  int digits;             ///< 0 for B, else 1
};

/// The largest unit in which `bytes` is at least 1.
inline ByteUnit byte_unit(std::uint64_t bytes) {
  static constexpr std::array<std::string_view, 7> kUnits = {"B",   "KiB", "MiB", "GiB",
                                                             "TiB", "PiB", "EiB"};
  std::size_t unit = 0;
  double scale = 1.0;
  while (unit + 1 < kUnits.size() && double(bytes) >= 1024.0 * scale) {
    scale *= 1024.0;
    ++unit;
  }
  return {kUnits[unit], scale, unit == 0 ? 0 : 1};
}

/// A byte count in the binary unit that reads best, e.g. "512 B", "33.8 MiB", "1.3 TiB".
inline std::string bytes_text(std::uint64_t bytes) {
  const ByteUnit u = byte_unit(bytes);
  return fmt::format("{:.{}f} {}", double(bytes) / u.scale, u.digits, u.name);
}

}  // namespace tpx
