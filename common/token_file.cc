#include "token_file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>

#include <fmt/format.h>

#include "check.h"
#include "checked.h"
#include "output.h"

#ifndef TPX_DEFAULT_DATA
#error "TPX_DEFAULT_DATA (the build's token file) is set by common/CMakeLists.txt"
#endif

namespace tpx {
namespace {

constexpr char kMagic[8] = {'T', 'P', 'X', 'T', 'O', 'K', 'N', '1'};
constexpr std::uint32_t kVersion = 1;

std::uint64_t read_le(const char* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

void put_le(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

ConfigError bad(const std::string& path, std::string_view rule) {
  return ConfigError(fmt::format("token file '{}': {}", path, rule));
}

struct Header {
  std::int64_t vocab;
  std::uint64_t n_train, n_valid;
};

// The header of a file of `size` bytes whose first bytes are `head` (up to 64 of them), checked.
Header check_header(const std::string& path, std::string_view head, std::uint64_t size) {
  const std::size_t magic = std::min(head.size(), sizeof kMagic);
  if (std::memcmp(head.data(), kMagic, magic) != 0 || (size == 0))
    throw bad(path,
              "not a token file (it does not start with \"TPXTOKN1\"; tpx_tokenize writes "
              "token files)");
  if (size < kTokenFileHeaderBytes)
    throw bad(path, fmt::format("truncated: {} bytes, shorter than the {}-byte header", size,
                                kTokenFileHeaderBytes));
  const auto version = std::uint32_t(read_le(head.data() + 8, 4));
  if (version != kVersion)
    throw bad(path, fmt::format("unsupported version {} (this build reads version {})", version,
                                kVersion));
  const Header h{std::int64_t(read_le(head.data() + 12, 4)), read_le(head.data() + 16, 8),
                 read_le(head.data() + 24, 8)};
  if (h.vocab < kTokenFileMinVocab || h.vocab > kTokenFileMaxVocab)
    throw bad(path, fmt::format("vocab {} is outside {} … {}", h.vocab, kTokenFileMinVocab,
                                kTokenFileMaxVocab));
  const auto ids = checked_add(h.n_train, h.n_valid);
  const auto id_bytes = ids ? checked_mul(*ids, std::uint64_t{2}) : std::nullopt;
  const auto expected =
      id_bytes ? checked_add(*id_bytes, std::uint64_t{kTokenFileHeaderBytes}) : std::nullopt;
  if (!expected || size < *expected)
    throw bad(path, fmt::format("truncated: {} bytes, but its header promises {} + 2·({} + {}) "
                                "bytes",
                                size, kTokenFileHeaderBytes, h.n_train, h.n_valid));
  if (size > *expected)
    throw bad(path, fmt::format("{} trailing bytes after the {} + 2·({} + {}) its header promises",
                                size - *expected, kTokenFileHeaderBytes, h.n_train, h.n_valid));
  if (h.n_train == 0) throw bad(path, "the training split is empty (n_train = 0)");
  if (h.n_valid == 0) throw bad(path, "the held-out split is empty (n_valid = 0)");
  return h;
}

// The first id ≥ vocab in `f` as (index in the file's id list, id), or index -1.
std::pair<std::int64_t, std::int64_t> first_bad_id(const TokenFile& f) {
  std::int64_t index = 0;
  for (const auto* split : {&f.train, &f.valid})
    for (const std::uint16_t id : *split) {
      if (id >= f.vocab) return {index, id};
      ++index;
    }
  return {-1, 0};
}

std::string bad_id_rule(const TokenFile& f, std::pair<std::int64_t, std::int64_t> at) {
  const auto n_train = std::int64_t(f.train.size());
  const std::string where = at.first < n_train
                                ? fmt::format("training split, index {}", at.first)
                                : fmt::format("held-out split, index {}", at.first - n_train);
  return fmt::format("id {} at token {} ({}) is not below the vocab {}", at.second, at.first, where,
                     f.vocab);
}

}  // namespace

std::string read_input_file(const std::string& path, std::string_view what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw ConfigError(fmt::format("{} '{}': cannot read (it is a directory)", what, path));
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw ConfigError(fmt::format("{} '{}': cannot read ({})", what, path, std::strerror(errno)));
  std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (in.bad())
    throw ConfigError(fmt::format("{} '{}': cannot read ({})", what, path, std::strerror(errno)));
  return bytes;
}

TokenFile read_token_file(const std::string& path) {
  const std::string bytes = read_input_file(path, "token file");
  const Header h =
      check_header(path, std::string_view(bytes).substr(0, kTokenFileHeaderBytes), bytes.size());
  TokenFile f;
  f.vocab = h.vocab;
  f.train.resize(h.n_train);
  f.valid.resize(h.n_valid);
  const char* p = bytes.data() + kTokenFileHeaderBytes;
  for (auto* split : {&f.train, &f.valid})
    for (std::uint16_t& id : *split) {
      id = std::uint16_t(read_le(p, 2));
      p += 2;
    }
  if (const auto at = first_bad_id(f); at.first >= 0) throw bad(path, bad_id_rule(f, at));
  return f;
}

void write_token_file(const std::string& path, const TokenFile& f) {
  if (f.vocab < kTokenFileMinVocab || f.vocab > kTokenFileMaxVocab)
    throw bad(path, fmt::format("vocab {} is outside {} … {}", f.vocab, kTokenFileMinVocab,
                                kTokenFileMaxVocab));
  if (f.train.empty()) throw bad(path, "the training split is empty");
  if (f.valid.empty()) throw bad(path, "the held-out split is empty");
  if (const auto at = first_bad_id(f); at.first >= 0) throw bad(path, bad_id_rule(f, at));
  std::string out(kMagic, sizeof kMagic);
  put_le(out, kVersion, 4);
  put_le(out, std::uint64_t(f.vocab), 4);
  put_le(out, f.train.size(), 8);
  put_le(out, f.valid.size(), 8);
  out.resize(kTokenFileHeaderBytes, '\0');
  out.reserve(kTokenFileHeaderBytes + 2 * (f.train.size() + f.valid.size()));
  for (const auto* split : {&f.train, &f.valid})
    for (const std::uint16_t id : *split) put_le(out, id, 2);
  write_file_atomically(path, [&](OutputFile& file) { file.write(out); });
}

std::int64_t token_file_vocab(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw ConfigError(fmt::format("token file '{}': cannot read (it is a directory)", path));
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw ConfigError(fmt::format("token file '{}': cannot read ({})", path, std::strerror(errno)));
  std::string head(kTokenFileHeaderBytes, '\0');
  in.read(head.data(), std::streamsize(head.size()));
  head.resize(std::size_t(in.gcount()));
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) throw ConfigError(fmt::format("token file '{}': cannot read ({})", path, ec.message()));
  return check_header(path, head, size).vocab;
}

std::string default_token_file() {
  return TPX_DEFAULT_DATA;
}

}  // namespace tpx
