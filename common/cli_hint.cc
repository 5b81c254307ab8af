#include "cli_hint.h"

#include <algorithm>
#include <cctype>
#include <string_view>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

namespace tpx {
namespace {

/// Optimal string alignment distance: Levenshtein plus the swap of two neighbours ("--haeds").
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t change = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + change});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

}  // namespace

std::string closest_flag(const std::string& given, const std::vector<std::string>& known) {
  const std::string_view name = std::string_view(given).substr(0, given.find('='));
  // Strip the dashes on both sides: "-layers" and "--layer" are both slips for "--layers".
  auto bare = [](std::string_view s) {
    return s.substr(std::min(s.find_first_not_of('-'), s.size()));
  };
  const std::string_view want = bare(name);
  if (want.empty()) return {};
  const std::size_t limit = want.size() <= 5 ? 1 : want.size() <= 10 ? 2 : 3;
  std::string best;
  std::size_t best_distance = limit + 1;
  std::vector<std::string> prefixed;
  for (const std::string& flag : known) {
    const std::string_view f = bare(flag);
    if (flag == name) continue;  // a flag given where it does not belong is not a slip
    if (f.starts_with(want) && want.size() >= 3) prefixed.push_back(flag);
    if (const std::size_t dist = edit_distance(want, f); dist < best_distance) {
      best_distance = dist;
      best = flag;
    }
  }
  if (!best.empty()) return best;
  return prefixed.size() == 1 ? prefixed.front() : std::string();
}

std::vector<std::string> visible_flags(const CLI::App& app) {
  std::vector<std::string> flags;
  for (const CLI::Option* opt : app.get_options())
    if (!opt->get_group().empty())
      for (const std::string& name : opt->get_lnames()) flags.push_back("--" + name);
  return flags;
}

namespace {

/// The length of the printable character at the start of `s` (1 to 4 bytes of UTF-8), or 0 when
/// it is not one: a control character, DEL, a C1 control (U+0080 … U+009F), an overlong or
/// surrogate encoding, a code point above U+10FFFF, or a byte outside a valid sequence.
std::size_t printable_length(std::string_view s) {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char b = byte(0);
  if (b < 0x80) return b >= 0x20 && b != 0x7f ? 1 : 0;
  // The sequence's length, and the range its second byte must lie in (which excludes overlong
  // forms, surrogates, code points beyond U+10FFFF and the C1 controls).
  std::size_t n = 0;
  unsigned char lo = 0x80, hi = 0xbf;
  if (b == 0xc2) {
    n = 2;
    lo = 0xa0;  // U+0080 … U+009F are the C1 controls
  } else if (b >= 0xc3 && b <= 0xdf) {
    n = 2;
  } else if (b == 0xe0) {
    n = 3;
    lo = 0xa0;
  } else if (b == 0xed) {
    n = 3;
    hi = 0x9f;
  } else if (b >= 0xe1 && b <= 0xef) {
    n = 3;
  } else if (b == 0xf0) {
    n = 4;
    lo = 0x90;
  } else if (b >= 0xf1 && b <= 0xf3) {
    n = 4;
  } else if (b == 0xf4) {
    n = 4;
    hi = 0x8f;
  } else {
    return 0;
  }
  if (s.size() < n || byte(1) < lo || byte(1) > hi) return 0;
  for (std::size_t i = 2; i < n; ++i)
    if (byte(i) < 0x80 || byte(i) > 0xbf) return 0;
  return n;
}

}  // namespace

std::size_t unprintable_at(std::string_view text) {
  for (std::size_t i = 0; i < text.size();) {
    const std::size_t n = printable_length(text.substr(i));
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

std::string printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    if (const std::size_t n = printable_length(text.substr(i)); n > 0) {
      out.append(text.substr(i, n));
      i += n;
    } else {
      out += text[i] == '\t' ? std::string("\\t")
                             : fmt::format("\\x{:02x}", static_cast<unsigned char>(text[i]));
      ++i;
    }
  }
  return out;
}

std::string parse_error_text(const CLI::App& app, const CLI::ParseError& e) {
  std::string text = e.what();
  // CLI11 says "check was given a disallowed flag override" of "--check=5": name the flag.
  if (const auto at = text.find(" was given a disallowed flag override"); at != std::string::npos)
    return printable(
        fmt::format("--{} is a switch and takes no value (see --help)", text.substr(0, at)));
  if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
    const std::vector<std::string> known = visible_flags(app);
    std::vector<std::string> hints;
    for (const std::string& arg : app.remaining())
      if (arg.size() > 1 && arg[0] == '-' && arg.find_first_not_of('-') != std::string::npos &&
          std::isalpha(static_cast<unsigned char>(arg[arg.find_first_not_of('-')])) != 0)
        if (const std::string flag = closest_flag(arg, known); !flag.empty())
          hints.push_back(fmt::format("{}: did you mean {}?", arg.substr(0, arg.find('=')), flag));
    if (!hints.empty()) text += fmt::format(" ({})", fmt::join(hints, "; "));
  }
  return printable(text + " (see --help)");
}

}  // namespace tpx
