// What a person reads when a command line does not parse: CLI11's message, and for a flag that
// does not exist the known flag closest to it ("--layer: did you mean --layers?").
//
// defines: tpx::closest_flag(), tpx::parse_error_text()
#pragma once

#include <string>
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

/// One line for `e`, thrown by `app.parse()`: CLI11's message, with "did you mean --X?" for
/// each unknown flag near a visible flag of `app`, ending "(see --help)".
std::string parse_error_text(const CLI::App& app, const CLI::ParseError& e);

}  // namespace tpx
