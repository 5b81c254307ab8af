// Which communicator a pipeline message travels on, and a check that the choice cannot deadlock.
//
// A communicator runs its ops in the order they are issued, one after another: NCCL queues every
// op of a communicator on one stream of its own. A rank that both sends and receives on one
// communicator therefore puts its sends behind its receives in one queue. The executor posts a
// receive one action ahead of the action that reads it, before the sends of the action it is
// about to run, and a receive that waits for a message the peer can only send after it has
// received this rank's next send blocks that send forever. Interleaved 1F1B at P = 2, M = 2 does
// exactly that: rank 0 queues "send F0@0's output, receive F0@1's output, send F1@0's output",
// rank 1 "receive F0@0's, receive F1@0's, send F0@1's".
//
// So each payload (activations, gradients) has a few communicators over the pipeline group, and
// a message travels on the one of its sender's color: a coloring of the ring of ranks in which
// neighbours differ (sender parity; the last rank a third color when P is odd, since its messages
// to rank 0 wrap around). A message goes from a rank to a neighbour, so no rank sends and
// receives on one communicator: each communicator's queue on a rank holds only sends to one peer
// or only receives from one, in the schedule's order, which both sides share.
//
// fifo_deadlock() plays the executor's order of issue against any assignment of messages to
// queues (the queues a rank's communicators give it), with a send completing only together with
// its receive, both at the head of their queues: the stuck messages, or none. The tests run it
// on every schedule with one communicator per payload (it deadlocks), with the colors and with
// the MPI backend's lanes (neither does).
//
// defines: tpx::pipeline::kReceivesAhead, channel_colors(), channel_color(), color_name(),
//          QueueOf, fifo_deadlock()
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "09_pipeline_parallel/schedule.h"

namespace tpx::pipeline {

/// How many actions ahead of the one that reads it the executor posts a receive (Executor::run);
/// fifo_deadlock() plays the same rule.
inline constexpr std::size_t kReceivesAhead = 1;

/// How many communicators a payload needs at P ranks: 1 at P = 1 (none is used), 2 when P is
/// even, 3 when it is odd.
int channel_colors(int ranks);
/// The color of pipeline rank `sender`: the communicator its messages travel on.
int channel_color(int sender, int ranks);
/// A color's word in its communicators' names, e.g. "pp group 0.0.0 act even": "even" and "odd"
/// for the ranks of that parity, "last" for the last rank of an odd P.
std::string color_name(int color);

/// The queue (a number, its meaning the caller's) that rank `rank`'s transfer `x` is issued to.
using QueueOf = std::function<int(int rank, const Transfer& x)>;

/// The transfers left when every rank issues its receives one action ahead and its sends after
/// the action that makes them, each onto its queue in that order; a queue's head starts when the
/// rank's compute has reached it (a receive: every action before the one it was posted at; a
/// send: its own action), and a send and its receive complete together, each at the head of its
/// queue. Empty: every message arrives and every action runs.
std::vector<Transfer> fifo_deadlock(const Schedule& schedule, const QueueOf& queue_of);

}  // namespace tpx::pipeline
