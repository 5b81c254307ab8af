// The device mesh (common/mesh.h) under mpirun: every split D × (N / D) of the job gives each rank
// the coordinates rank = dp·T + tp, groups of the right members in the right order, communicators
// whose sums stay inside their group, symmetric memory over a TP group, and one clear error for
// a D that does not divide the job, or sizes whose product leaves the int range.
#include <mpi.h>

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "05_copy_engine_async_tp/symmetric_memory.h"
#include "common/check.h"
#include "common/comm/communicator.h"
#include "common/mesh.h"
#include "common/trace.h"
#include "test_mpi.h"

namespace tpx {
namespace {

using test::world_rank;
using test::world_size;

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

TEST(Mesh, CoordinatesAndGroupsFollowTpInnermost) {
  const int n = world_size(), me = world_rank();
  for (const int dp : divisors(n)) {
    const Mesh m = Mesh::make(dp);
    const int tp = n / dp;
    EXPECT_EQ(m.dp, dp);
    EXPECT_EQ(m.tp, tp);
    EXPECT_EQ(m.dp_index * tp + m.tp_index, me) << m.describe();
    ASSERT_EQ(m.tp_group.size(), tp);
    ASSERT_EQ(m.dp_group.size(), dp);
    EXPECT_EQ(m.tp_group.rank(), m.tp_index);
    EXPECT_EQ(m.dp_group.rank(), m.dp_index);
    for (int t = 0; t < tp; ++t)  // consecutive job ranks: a TP group fills a node
      EXPECT_EQ(m.tp_group.world_rank_of(t), m.dp_index * tp + t) << m.describe();
    for (int d = 0; d < dp; ++d)  // strided by T
      EXPECT_EQ(m.dp_group.world_rank_of(d), d * tp + m.tp_index) << m.describe();
    if (dp > 1) {
      EXPECT_NE(m.dp_group.describe_rank(0).find("of dp group"), std::string::npos);
      EXPECT_NE(m.dp_group.describe_rank(0).find("job rank"), std::string::npos);
    }
  }
}

TEST(Mesh, SumsStayInsideTheirGroup) {
  const int n = world_size(), me = world_rank();
  for (const int dp : divisors(n)) {
    const Mesh m = Mesh::make(dp);
    for (const bool over_tp : {true, false}) {
      CommOptions o;
      o.kind = CommKind::mpi;
      o.timeout_s = 60;
      o.group = over_tp ? m.tp_group : m.dp_group;
      const auto comm = make_communicator(o, Device::cpu);
      ASSERT_EQ(comm->size(), o.group.size());
      Tensor t = Tensor::empty({2});
      t.f32()[0] = float(me);
      t.f32()[1] = 1.0f;
      Stream s;
      comm->all_reduce(t, s);
      float want = 0;
      for (int r = 0; r < o.group.size(); ++r) want += float(o.group.world_rank_of(r));
      EXPECT_EQ(t.f32()[0], want) << m.describe() << (over_tp ? " tp" : " dp");
      EXPECT_EQ(t.f32()[1], float(o.group.size()));
    }
  }
}

TEST(Mesh, SymmetricMemoryOverATpGroupSeesOnlyItsPeers) {
  const int n = world_size();
  for (const int dp : divisors(n)) {
    const Mesh m = Mesh::make(dp);
    SymmetricOptions o;
    o.timeout_s = 60;
    o.group = m.tp_group;
    auto mem = make_symmetric_memory(Device::cpu, sizeof(float), o, Trace::off());
    ASSERT_EQ(mem->world(), m.tp);
    ASSERT_EQ(mem->rank(), m.tp_index);
    mem->local({1}, DType::f32, 0).f32()[0] = float(world_rank());
    mem->barrier();
    for (int p = 0; p < m.tp; ++p) {
      const Tensor got = Tensor::empty({1});
      mem->pull(p, 0, got, mem->copy_stream(), "mesh test pull");
      mem->copy_stream().synchronize();
      EXPECT_EQ(got.f32()[0], float(m.tp_group.world_rank_of(p))) << m.describe();
    }
    mem->barrier();
  }
}

TEST(Mesh, ADpThatDoesNotDivideTheJobIsOneLine) {
  const int n = world_size();
  for (const int bad : {0, n + 1, -2}) {
    try {
      (void)Mesh::make(bad);
      ADD_FAILURE() << "--dp " << bad << " was accepted for " << n << " ranks";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("must divide the"), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
  }
}

// P·D·C of sizes near the int range: checked, never wrapped into a product that seems to divide
// the job (2147483647 · 2 wraps to −2, which divides 2, 4 and 6; 65536 · 65536 wraps to 0).
TEST(Mesh, SizesWhoseProductLeavesTheIntRangeAreOneLineNotAWrappedProduct) {
  const int n = world_size();
  constexpr int big = std::numeric_limits<int>::max();
  struct Case {
    int dp, cp, pp;
    std::string words;
  };
  for (const Case& c :
       {Case{big, 2, 1, n % 2 == 0 ? "--dp 2147483647 × --cp 2 must divide" : "--cp 2 must divide"},
        Case{65536, 1, 65536, "--pp 65536 must divide"},
        Case{65536, 65536, 65536, "--pp 65536 must divide"},
        Case{big, big, 1, "--cp 2147483647 must divide"}}) {
    SCOPED_TRACE(c.words);
    const std::string p = Mesh::problem(n, c.dp, c.cp, c.pp);
    EXPECT_NE(p.find(c.words), std::string::npos) << p;
    try {
      (void)Mesh::make(c.dp, c.cp, c.pp);
      ADD_FAILURE() << "accepted for " << n << " ranks";
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()), p);
    }
  }
  // The largest product that does divide is accepted at the edge of the checks (P·D·C = n).
  EXPECT_EQ(Mesh::problem(n, 1, 1, n), "");
  EXPECT_EQ(Mesh::problem(big - 1, 2, 1, 1), "") << "2 divides 2147483646";
  EXPECT_NE(Mesh::problem(big, big, 2, 1), "");
  // A size the stage chose is named by its letter, not blamed on a flag nobody typed.
  const std::string chosen = Mesh::problem(2, big, 2, 2, {.pp = false, .dp = true, .cp = true});
  EXPECT_NE(chosen.find("P 2 (--pp's default) × --cp 2 must divide the 2 ranks"), std::string::npos)
      << chosen;
}

}  // namespace
}  // namespace tpx
