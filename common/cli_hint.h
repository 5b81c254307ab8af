// What a person reads when a command line does not parse: CLI11's message, and for a flag that
// does not exist the known flag closest to it ("--layer: did you mean --layers?"); every byte of
// user input it quotes that a terminal would act on, escaped.
//
// defines: tpx::closest_flag(), tpx::visible_flags(), tpx::printable(), tpx::unprintable_at(),
//          tpx::parse_error_text()
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace CLI {
class App;
class ParseError;
}  // namespace CLI

namespace tpx {

/// The flag of `known` nearest to `given` by edit distance (insertions, deletions, substitutions
/// and swaps of neighbours, each 1), if it is near enough to be a slip: at most 1 edit for
/// flags of up to 5 characters, 2 up to 10, 3 beyond; or `given` is an unambiguous prefix of
/// it. Empty when none is. `given` may carry a value ("--layer=3": the part before '=').
std::string closest_flag(const std::string& given, const std::vector<std::string>& known);

/// The flags --help shows (hidden options, in the empty group, are left out), as "--name".
std::vector<std::string> visible_flags(const CLI::App& app);

/// Where `text` first holds a byte that is not printable text: a control character (a tab too),
/// DEL, a C1 control, or a byte that is not part of valid UTF-8; npos when there is none.
/// Printable UTF-8 ("×", "…") is text.
std::size_t unprintable_at(std::string_view text);

/// `text` with every byte that unprintable_at() objects to written as a backslash, "x" and two
/// hex digits (a tab as a backslash and "t": C's escapes), so that a message quoting user input
/// prints as one line and cannot drive the terminal.
std::string printable(std::string_view text);

/// One line for `e`, thrown by `app.parse()`: CLI11's message, with "did you mean --X?" for
/// each unknown flag near a visible flag of `app`, ending "(see --help)"; printable().
std::string parse_error_text(const CLI::App& app, const CLI::ParseError& e);

}  // namespace tpx
