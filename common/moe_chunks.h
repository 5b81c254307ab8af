// The chunked overlap of the expert-parallel layer's two paths (moe_ep.cc, moe_ep_ops.cc): each
// chunk's send, compute and give-back, on a lane or in line.
//
// defines: tpx::moe_detail::run_chunks()
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "stream.h"

namespace tpx::moe_detail {

/// Runs C chunks' `send` (on the lane), `compute` (here) and `give_back` (on the lane), each
/// chunk's after its send and its give_back after its compute. With a lane, chunk c + 1's send and
/// chunk c − 1's give_back run while chunk c computes, the lane taking them in the order send 0,
/// send 1, give_back 0, send 2, give_back 1, … (the same on every rank: they are collectives);
/// without one, or with one chunk, one after the other here.
template <class Send, class Compute, class GiveBack>
void run_chunks(std::int64_t C, const Stream* lane, Send& send, Compute& compute,
                GiveBack& give_back) {
  if (!lane || C == 1) {
    for (std::int64_t c = 0; c < C; ++c) {
      send(c);
      compute(c);
      give_back(c);
    }
    return;
  }
  std::vector<Event> sent(static_cast<std::size_t>(C));
  auto issue = [&](std::int64_t c) {
    sent[static_cast<std::size_t>(c)] = run_after_compute(*lane, {}, [&send, c] { send(c); });
  };
  try {
    issue(0);
    issue(1);
    for (std::int64_t c = 0; c < C; ++c) {
      sent[static_cast<std::size_t>(c)].synchronize();
      compute(c);
      run_after_compute(*lane, {}, [&give_back, c] { give_back(c); });
      if (c + 2 < C) issue(c + 2);
    }
    lane->synchronize();
  } catch (...) {
    // The lane's tasks read this frame's buffers: they end before it does.
    try {
      lane->synchronize();
    } catch (...) {  // NOLINT(bugprone-empty-catch): the first failure is the one to report
    }
    throw;
  }
}

}  // namespace tpx::moe_detail
