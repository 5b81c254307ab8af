// The token file: a tokenized text, its training and held-out splits, as the stages read it.
//
// Layout (every number little-endian):
//   bytes  0 …  7  magic "TPXTOKN1"
//          8 … 11  u32 version (1)
//         12 … 15  u32 vocab V (2 … 65536): every id is below it
//         16 … 23  u64 n_train
//         24 … 31  u64 n_valid
//         32 … 63  zero
//   then n_train + n_valid u16 ids: the training split, then the held-out split.
// tools/tpx_tokenize writes it; a file that breaks any rule above (or has an empty split) is
// refused whole, naming the file and the rule, before anything uses it.
//
// defines: tpx::TokenFile, tpx::read_token_file(), tpx::write_token_file(),
//          tpx::token_file_vocab(), tpx::default_token_file(), tpx::read_input_file(),
//          tpx::kTokenFileHeaderBytes
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tpx {

inline constexpr std::size_t kTokenFileHeaderBytes = 64;
/// The vocabulary sizes a token file may declare: two ids at least, at most what a u16 holds.
inline constexpr std::int64_t kTokenFileMinVocab = 2;
inline constexpr std::int64_t kTokenFileMaxVocab = 65536;

struct TokenFile {
  std::int64_t vocab = 0;
  std::vector<std::uint16_t> train, valid;
};

/// The whole file, checked: throws tpx::ConfigError "token file '<path>': <rule>" for a file that
/// cannot be read, is not a token file (its magic), has another version, is truncated or has
/// bytes past its ids, declares a vocab outside 2 … 65536, holds an id ≥ vocab (the first one, with
/// its index), or has an empty split.
TokenFile read_token_file(const std::string& path);

/// Writes `f` whole or not at all (common/output.h). Throws tpx::ConfigError for a TokenFile that
/// read_token_file() would refuse (its vocab, an id, an empty split).
void write_token_file(const std::string& path, const TokenFile& f);

/// The vocab of the token file `path`, from its header alone (checked as read_token_file() checks
/// it, all but the ids).
std::int64_t token_file_vocab(const std::string& path);

/// The token file the build made from the King James Version (V = 4096, a tenth held out):
/// `<build>/data/kjv-4096.tokens`. The path only: the build makes it where the `bible` program
/// is installed (scripts/setup.sh installs it), so the caller checks that it exists.
std::string default_token_file();

/// The bytes of the file `path`; throws tpx::ConfigError "<what> '<path>': cannot read (<reason>)"
/// if it cannot be opened or read, or is a directory.
std::string read_input_file(const std::string& path, std::string_view what);

}  // namespace tpx
