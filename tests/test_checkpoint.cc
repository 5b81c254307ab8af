// The checkpoint format's primitives (common/checkpoint.h), and where the cut places each
// tensor of the training state.
#include "common/checkpoint.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "common/model.h"

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

// The boxes state_parts() gives the ranks of a T-way cut: the parts each rank saves tile every
// global tensor exactly once (a replicated one on rank 0 alone, the vocabulary's padding on
// nobody), and every rank's box of a tensor is the part it holds. T = 3 pads the vocabulary of
// 50 to 51: the last rank holds 16 real ids and one of padding. At V = 5, T = 4 pads it to 8 and
// rank 3 holds padding alone: an empty box.
TEST(Checkpoint, SavedPartsTileEveryTensorOnce) {
  tpx::BlockConfig c;
  c.hidden = 24;
  c.heads = 6;
  c.ffn = 48;
  c.layers = 2;
  c.task = tpx::Task::lm;
  c.vocab = 50;
  c.optimizer = tpx::Optimizer::adamw;
  for (auto [vocab, world] : {std::pair{50, 1}, {50, 2}, {50, 3}, {5, 4}}) {
    c.vocab = vocab;
    const auto whole = tpx::state_parts(c, tpx::Sharding{});
    std::vector<std::vector<int>> hits(whole.size());
    for (std::size_t i = 0; i < whole.size(); ++i) {
      std::size_t n = 1;
      for (auto d : whole[i].shape) n *= std::size_t(d);
      hits[i].assign(n, 0);
    }
    for (int rank = 0; rank < world; ++rank) {
      const tpx::Sharding s{.rank = rank, .world = world, .weights = world > 1};
      const auto parts = tpx::state_parts(c, s);
      ASSERT_EQ(parts.size(), whole.size());
      // 2 layers × 9, the language model's 3, all twice more for AdamW's moments.
      EXPECT_EQ(parts.size(), std::size_t(3 * (2 * 9 + 3)));
      for (std::size_t i = 0; i < parts.size(); ++i) {
        const auto& p = parts[i];
        EXPECT_EQ(p.name, whole[i].name);
        EXPECT_EQ(p.shape, whole[i].shape);
        ASSERT_EQ(p.box.size(), p.shape.size());
        for (std::size_t d = 0; d < p.box.size(); ++d) {
          EXPECT_LE(p.box[d].length, p.local[d]) << p.name;  // at the local tensor's origin
          EXPECT_LE(p.box[d].start + p.box[d].length, p.shape[d]) << p.name;
        }
        if (!p.saved) continue;
        const std::int64_t cols = p.shape.size() > 1 ? p.shape[1] : 1;
        const std::int64_t rows0 = p.box[0].start, rows = p.box[0].length;
        const std::int64_t col0 = p.box.size() > 1 ? p.box[1].start : 0;
        const std::int64_t ncols = p.box.size() > 1 ? p.box[1].length : 1;
        for (std::int64_t r = rows0; r < rows0 + rows; ++r)
          for (std::int64_t k = col0; k < col0 + ncols; ++k) ++hits[i][std::size_t(r * cols + k)];
      }
    }
    for (std::size_t i = 0; i < whole.size(); ++i)
      EXPECT_TRUE(std::ranges::all_of(hits[i], [](int h) { return h == 1; }))
          << whole[i].name << " at T = " << world;
  }
}

// The box a checkpoint records for a rank's shard is where the initialiser drew that shard from:
// make_model's values on a rank of a two-way cut equal the unsharded model's in its box.
TEST(Checkpoint, BoxesAreWhereTheModelIsCut) {
  tpx::BlockConfig c;
  c.hidden = 16;
  c.heads = 4;
  c.ffn = 32;
  c.layers = 1;
  c.task = tpx::Task::lm;
  c.vocab = 21;
  const tpx::Model whole = tpx::make_model(c, tpx::Sharding{});
  for (int rank = 0; rank < 2; ++rank) {
    const tpx::Sharding s{.rank = rank, .world = 2, .weights = true};
    const tpx::Model mine = tpx::make_model(c, s);
    const auto parts = tpx::state_parts(c, s);
    std::vector<const tpx::Tensor*> got, want;
    for (tpx::Param p : tpx::kAllParams) {
      got.push_back(&mine.params[0][p]);
      want.push_back(&whole.params[0][p]);
    }
    for (int i = 0; i < tpx::kLmParams; ++i) {
      got.push_back(mine.lm.all()[std::size_t(i)]);
      want.push_back(whole.lm.all()[std::size_t(i)]);
    }
    ASSERT_EQ(parts.size(), got.size());
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const auto& p = parts[i];
      const auto g = got[i]->f32(), w = want[i]->f32();
      const std::int64_t wcols = want[i]->shape().size() > 1 ? want[i]->shape()[1] : 1;
      const std::int64_t gcols = p.local.size() > 1 ? p.local[1] : 1;
      const std::int64_t r0 = p.box[0].start, c0 = p.box.size() > 1 ? p.box[1].start : 0;
      const std::int64_t nc = p.box.size() > 1 ? p.box[1].length : 1;
      for (std::int64_t r = 0; r < p.box[0].length; ++r)
        for (std::int64_t k = 0; k < nc; ++k)
          ASSERT_EQ(g[std::size_t(r * gcols + k)], w[std::size_t((r0 + r) * wcols + c0 + k)])
              << p.name << " rank " << rank << " at (" << r << ", " << k << ")";
    }
  }
}

}  // namespace
