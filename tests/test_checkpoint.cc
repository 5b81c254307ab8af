// The checkpoint format's primitives (common/checkpoint.h).
#include "common/checkpoint.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>

namespace {

// The standard check value of CRC-32/IEEE: the CRC of the nine ASCII digits "123456789".
TEST(Checkpoint, Crc32MatchesTheStandardCheckValue) {
  const char* digits = "123456789";
  EXPECT_EQ(tpx::crc32(digits, 9), 0xCBF43926U);
}

TEST(Checkpoint, Crc32OfNothingIsZero) {
  EXPECT_EQ(tpx::crc32(nullptr, 0), 0U);
}

// The CRC of "a" (a published value) and of one zero byte (0xD202EF8D).
TEST(Checkpoint, Crc32OfSingleBytes) {
  EXPECT_EQ(tpx::crc32("a", 1), 0xE8B7BE43U);
  const unsigned char zero = 0;
  EXPECT_EQ(tpx::crc32(&zero, 1), 0xD202EF8DU);
}

TEST(Checkpoint, Crc32ContinuesAcrossPieces) {
  const std::string s = "The quick brown fox jumps over the lazy dog";
  EXPECT_EQ(tpx::crc32(s.data(), s.size()), 0x414FA339U);
  for (std::size_t cut = 0; cut <= s.size(); ++cut)
    EXPECT_EQ(tpx::crc32(s.data() + cut, s.size() - cut, tpx::crc32(s.data(), cut)), 0x414FA339U);
}

TEST(Checkpoint, Crc32SeesAFlippedBit) {
  std::string s(1000, 'x');
  const std::uint32_t clean = tpx::crc32(s.data(), s.size());
  s[517] = static_cast<char>(s[517] ^ 0x10);
  EXPECT_NE(tpx::crc32(s.data(), s.size()), clean);
}

}  // namespace
