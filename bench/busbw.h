// nccl-tests' bandwidth convention for collectives, written once: the collectives benchmark
// reports it, and the tests check it by hand.
//
// Source: NVIDIA nccl-tests, doc/PERFORMANCE.md
// (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).
//
//   algbw = size / time, where size is the bytes nccl-tests counts for the op:
//           all_reduce, broadcast, sendrecv  the buffer of one rank
//           all_gather, reduce_scatter       the whole gathered buffer (N · one rank's part)
//   busbw = algbw · factor(op, N), the bytes each rank sends over its links per second in a ring
//           algorithm, so that it can be compared with the hardware's link bandwidth:
//           all_reduce                  2(N−1)/N   (a reduce-scatter, then an all-gather)
//           all_gather, reduce_scatter  (N−1)/N    (each rank receives N−1 of the N parts)
//           broadcast, sendrecv         1
//   The symmetric-memory pull (each rank pulls the N−1 parts of its peers, an all-gather made of
//   copies) is counted like all_gather.
//
// GB/s are 10⁹ bytes per second, as in nccl-tests.
//
// defines: tpx::bench::Collective, collective_name(), bus_factor(), algbw_GBps(), busbw_GBps()
#pragma once

#include <string_view>

namespace tpx::bench {

enum class Collective { all_reduce, all_gather, reduce_scatter, broadcast, sendrecv, symm_pull };

constexpr std::string_view collective_name(Collective op) {
  switch (op) {
    case Collective::all_reduce:
      return "all_reduce";
    case Collective::all_gather:
      return "all_gather";
    case Collective::reduce_scatter:
      return "reduce_scatter";
    case Collective::broadcast:
      return "broadcast";
    case Collective::sendrecv:
      return "sendrecv";
    case Collective::symm_pull:
      return "symm_pull";
  }
  return "?";
}

/// busbw / algbw for `op` over `ranks` ranks (0 for an all-to-all op on one rank: nothing moves).
constexpr double bus_factor(Collective op, int ranks) {
  const double n = ranks;
  switch (op) {
    case Collective::all_reduce:
      return 2.0 * (n - 1.0) / n;
    case Collective::all_gather:
    case Collective::reduce_scatter:
    case Collective::symm_pull:
      return (n - 1.0) / n;
    case Collective::broadcast:
    case Collective::sendrecv:
      return 1.0;
  }
  return 0.0;
}

/// Algorithm bandwidth in GB/s: `bytes` (nccl-tests' size of the op) moved in `seconds`.
constexpr double algbw_GBps(double bytes, double seconds) {
  return seconds > 0.0 ? bytes / seconds / 1e9 : 0.0;
}

/// Bus bandwidth in GB/s.
constexpr double busbw_GBps(Collective op, int ranks, double bytes, double seconds) {
  return algbw_GBps(bytes, seconds) * bus_factor(op, ranks);
}

}  // namespace tpx::bench
