#include "08_context_parallel/memory.h"

namespace tpx::cp {
namespace {

using namespace memory;  // NOLINT: the estimate's vocabulary

/// Context parallelism's attention buffers at their largest, in backward (kv = this rank's K/V
/// block [S/C, B/D, NKV/T·Dh]; q likewise with NH/T heads):
///   ring       its own block packed [k | v], the block in flight, two dK/dV partials and
///              the one arriving: 2·kv each, 6 in all, plus the last hop's arrival
///   allgather  every rank's block gathered, their dK/dV, this rank's own and its share of
///              the reduce-scatter: (2C + 2)·2·kv
///   ulysses    the head-sharded copies of q, k, v, out, dO and of dq, dk, dv (each as big as
///              the rank's own), plus one all-to-all's host send, receive and reorder buffers
Count attention_buffers(CpMethod method, int cp, const ActivationBytes& b) {
  const char* what = "CP attention buffers";
  const Count kv2 = product({b.cols_kv, 2}, what);
  switch (method) {
    case CpMethod::ring:
      return product({kv2, 7}, what);
    case CpMethod::allgather:
      return product({kv2, 2 * Count(cp) + 2}, what);
    case CpMethod::ulysses:
      return sum({product({b.cols_h, 7}, what), product({b.cols_kv, 4}, what)}, what);
  }
  return 0;
}

class CpMemory final : public MemoryDimension {
 public:
  explicit CpMemory(CpMethod method) : method_(method) {}
  void add_terms(MemoryEstimate& e, const MemoryParts& p) const override {
    if (p.sharding.cp == 1) return;  // the whole sequence: no other rank's keys
    e.terms.push_back({"CP attention buffers",
                       std::uint64_t(attention_buffers(method_, p.sharding.cp, p.pass_bytes))});
  }

 private:
  CpMethod method_;
};

}  // namespace

std::shared_ptr<const MemoryDimension> memory_dimension(CpMethod method) {
  return std::make_shared<CpMemory>(method);
}

}  // namespace tpx::cp
