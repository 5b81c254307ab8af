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

using R = tpx::IndexRange;

// Rows 0..7 of a [16, 4] tensor (rank 0 of a two-way row cut) against rows 4..11 (rank 1 of a
// cut of the middle): they share rows 4..7, every column.
TEST(Checkpoint, OverlapOfTwoRowCuts) {
  const auto box = tpx::overlap({R{0, 8}, R{0, 4}}, {R{4, 8}, R{0, 4}});
  ASSERT_TRUE(box.has_value());
  EXPECT_EQ(*box, (std::vector<R>{R{4, 4}, R{0, 4}}));
}

TEST(Checkpoint, OverlapOfARowAndAColumnCut) {
  const auto box = tpx::overlap({R{8, 8}, R{0, 4}}, {R{0, 16}, R{2, 2}});
  ASSERT_TRUE(box.has_value());
  EXPECT_EQ(*box, (std::vector<R>{R{8, 8}, R{2, 2}}));
}

TEST(Checkpoint, DisjointOrTouchingPartsShareNothing) {
  EXPECT_FALSE(tpx::overlap({R{0, 8}}, {R{8, 8}}).has_value());
  EXPECT_FALSE(tpx::overlap({R{0, 4}, R{0, 4}}, {R{0, 4}, R{5, 1}}).has_value());
  EXPECT_FALSE(tpx::overlap({R{0, 4}}, {R{0, 4}, R{0, 1}}).has_value());
}

}  // namespace
