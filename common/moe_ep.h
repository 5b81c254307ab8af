// The mixture-of-experts MLP of common/moe.h with its routed experts spread over the EP ranks of a
// communicator (expert parallelism), on the cpu, in double (checked against moe_forward and
// moe_backward over all tokens) and float.
//
// Each EP rank r holds E/EP consecutive experts, r·E/EP … (r+1)·E/EP − 1, the whole router and the
// shared experts, and a slice of the tokens: the ranks' slices, in rank order, are the tokens of
// the single-process layer in token order. Forward on rank r:
//   1. route its own tokens with moe_route (the same scores, choices and ties as moe.h);
//   2. capacity: the per-expert assignment counts (and token counts) are all-gathered over the EP
//      group; with T_all tokens in all and c = moe_capacity(T_all), rank r's assignment of its
//      token t to e is kept iff (the assignments to e of the ranks before r) + (those of its own
//      tokens before t) < c: exactly moe_route's rule over all tokens in token order (or, when a
//      rank's tokens are runs at places of their own in that order, MoeTokenOrder, the counts are
//      per run, and "before" is the runs placed before t's);
//   3. dispatch: the rows x_t of its kept assignments, grouped by destination rank (the owner of
//      the expert), within a destination by expert, within an expert in token order, are sent
//      with Communicator::all_to_all_v, after an all-to-all of the row counts per (destination,
//      expert);
//   4. each local expert runs on the rows it received (one call per expert over its group, the
//      rows from rank 0 first: token order), giving its unscaled output expert_e(x_t);
//   5. combine: the reverse all-to-all returns the outputs; y_t = Σ_j w_j·out_j + shared(x_t).
// Backward mirrors it: w_j·dy_t is dispatched, the experts' backward accumulates their weights'
// gradients and returns ∂loss/∂x rows (combine), the gate weights' gradients dy_t·out_j and the
// router's gradient (the auxiliary loss's included) are formed on the token's own rank.
//
// Bytes (B = the element size, n_{r→d} = kept assignments of rank r's tokens to experts of rank d,
// Σ_d n_{r→d} = T_r·k − the drops of rank r's tokens), per rank r and pass:
//   counts  forward: an all_gather of (E + 1) i32 per rank ((P·E + 1) for P runs a rank), then
//           an all_to_all_v of E i32
//           (payload 4·E, bus 4·(E − E/EP));
//   dispatch (forward x, backward w·dy): payload Σ_d n_{r→d}·H·B, bus Σ_{d≠r} n_{r→d}·H·B;
//   combine  (forward out, backward dx): payload Σ_s n_{s→r}·H·B, bus Σ_{s≠r} n_{s→r}·H·B.
// (Communicator's accounting: communicator.h. Float rows travel as f32, double rows as their bytes,
// recorded as u8.)
//
// Equality with moe_forward/moe_backward over all tokens, in double: the routing and the drops
// exactly; y, dx, the router's and the shared experts' gradients (summed over the ranks), the
// routed experts' gradients and L_aux (the parts summed) to rounding, since the gate weight is
// applied on the token's rank instead of inside the expert and the sums over ranks are in another
// order (tests/test_moe_ep.cc: 1e-12 relative to the largest element).
//
// The same layer on either backend (moe_ep_ops.cc, stage 10's): the parameters, the tokens and
// every row buffer are f32 tensors on the run's device, the math is tpx::ops (the routing and the
// row moves: common/ops.h's MoE ops; the experts' GEMMs: ops::gemm_grouped over the groups of
// rows that one rank sent one expert), and the bookkeeping of steps 2 and 3 (which assignment is kept, which
// row goes where: integers, T·k of them) runs on the host from the choices copied back, as
// moe_ep_plan() does it for both paths.
//
// defines: tpx::moe_ep_check(), tpx::MoeEpOverlap, tpx::MoeTokenOrder, tpx::MoeEpChunk,
//          tpx::MoeEpForward, tpx::moe_ep_forward(), tpx::moe_ep_backward(), tpx::MoeEpPlan,
//          tpx::moe_ep_plan(), tpx::MoeTensors, tpx::MoeEpOpsForward, tpx::moe_ep_ops_forward(), tpx::MoeTensorGrads,
//          tpx::moe_ep_ops_backward(), tpx::MoeEpTraffic, tpx::moe_ep_traffic(),
//          tpx::moe_balanced_rows()
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/moe.h"
#include "common/tensor.h"
#include "common/trace.h"
#include "common/traffic.h"

namespace tpx {

class Communicator;
class Stream;

/// Refuses E not divisible by EP with tpx::ConfigError naming --experts and --ep.
void moe_ep_check(std::int64_t experts, int ep);

/// How a layer cuts its dispatch, experts and combine (--moe-chunks): `chunks` parts of the
/// rank's tokens in order, each with its own counts and row exchanges. With a `lane` (a stream
/// made by Stream::create), chunk c + 1's dispatch and chunk c − 1's combine run on it while the
/// experts run on chunk c on the calling thread; the lane's order, dispatch 0, dispatch 1,
/// combine 0, dispatch 2, combine 1, …, is the same on every rank. `trace`: the exchanges' spans
/// on Lane::ep_comm, the counts' all_gather on Lane::dp_comm, the compute on Lane::compute.
/// The outputs are the same for every cut; the experts' weight gradients sum their rows in
/// chunk order (rounding).
struct MoeEpOverlap {
  int chunks = 1;
  const Stream* lane = nullptr;
  Trace* trace = nullptr;
};

/// Where the token group's tokens lie in the order the capacity counts them in (step 2 above).
/// Each rank's T_r tokens are `pieces` runs of T_r/pieces consecutive tokens, and run p of the
/// group's rank q is at place keys[q·pieces + p] among all the runs (a permutation of 0 …
/// ranks·pieces − 1). The default, one run per rank in rank order, is the data-parallel
/// replicas' whole sequences; stage 10 under context parallelism gives each sequence's two
/// chunks their places in the sequence.
struct MoeTokenOrder {
  std::int64_t pieces = 1;
  std::vector<std::int64_t> keys;  ///< empty: rank order
};

/// One chunk's exchanges: the rows of this rank's tokens [c·T_r/C, (c+1)·T_r/C).
struct MoeEpChunk {
  std::vector<std::int64_t> send_rows;    ///< [EP] rows dispatched to each rank
  std::vector<std::int64_t> recv_rows;    ///< [EP] rows received from each rank
  std::vector<std::int64_t> recv_counts;  ///< [EP, E/EP] rows from each rank for each local expert
  std::int64_t first_sent = 0;            ///< its first row's index in sent and out
  std::int64_t first_recv = 0;            ///< its first row's index in recv, gate and up
};

/// This rank's forward: its tokens' output and what its backward needs.
template <class T>
struct MoeEpForward {
  HostVector<T> y;  ///< [T_r, H]
  T aux_loss{};     ///< this rank's part of L_aux: the parts sum to L_aux over the EP ranks
  /// This rank's tokens' routing, kept by the capacity over all tokens (above);
  /// routed_per_expert and tokens_per_expert count this rank's tokens only.
  MoeRouting<T> routing;
  std::vector<std::int64_t> routed_all;  ///< [E] assignments all ranks' tokens chose
  std::int64_t tokens_all = 0;           ///< T_all
  HostVector<T> logits;                  ///< [T_r, E]
  HostVector<T> shared_gate, shared_up;  ///< [T_r, SF]
  std::vector<std::int64_t> send_rows;   ///< [EP] n_{r→d}: rows dispatched to each rank
  std::vector<std::int64_t> recv_rows;   ///< [EP] n_{s→r}: rows received from each rank
  std::vector<MoeEpChunk> chunks;        ///< each chunk's part (one without a cut)
  std::vector<std::int64_t> sent;  ///< [Σ send_rows] each dispatched row's assignment t·k + j
  HostVector<T> recv;              ///< [Σ recv_rows, H] the received rows x, chunk by chunk
  HostVector<T> gate, up;          ///< [Σ recv_rows, FE] the local experts' pre-activations
  HostVector<T> out;               ///< [Σ send_rows, H] the experts' outputs, combined
};

/// Forward of this rank's tokens x [m.tokens = T_r, H]. w: the router [H, E], this rank's E/EP
/// experts ([E/EP, H, FE], [E/EP, FE, H]) and the shared experts; bias [E] or empty. Collective
/// over `ep` (EP = ep.size()); E not divisible by EP is refused (moe_ep_check) before any
/// communication. `token_group`: the ranks whose tokens, in rank order, the capacity and the
/// auxiliary loss run over (step 2 above: its all_gather of the counts), a group that holds
/// several EP groups (stage 10's data-parallel ranks); null: `ep` itself.
/// `order`: where its ranks' tokens lie in the capacity's order (MoeTokenOrder).
template <class T>
MoeEpForward<T> moe_ep_forward(const MoeShape& m, const MoeWeights<T>& w, std::span<const T> x,
                               std::span<const T> bias, Communicator& ep, const Stream& s,
                               Communicator* token_group = nullptr, const MoeEpOverlap& o = {},
                               const MoeTokenOrder& order = {});

/// Backward for dy [T_r, H]: dx of this rank's tokens, this rank's experts' gradients (complete),
/// and this rank's part of the router's and shared experts' gradients (they sum over the ranks).
/// `tp`: the experts' width (FE and SF) is cut over this TP group, every rank of it holding the
/// same tokens, routing and dy, its own columns of w_gate and w_up and rows of w_down (expert
/// tensor parallelism, as Megatron-LM's): the gate weights' gradients are summed over it (one
/// all-reduce of T_r·K values; float only), the router's gradient is then the same on every
/// rank, and dx is each rank's part (the router's part on rank 0 of the group alone), to be
/// summed over the group by the caller.
/// `o`: the forward's cut (its chunks), and the lane and trace as there.
template <class T>
MoeGrads<T> moe_ep_backward(const MoeShape& m, const MoeWeights<T>& w, std::span<const T> x,
                            const MoeEpForward<T>& f, std::span<const T> dy, Communicator& ep,
                            const Stream& s, Communicator* tp = nullptr,
                            const MoeEpOverlap& o = {});

/// Steps 2 and 3 from this rank's choices, the same for both paths: the capacity's drops over
/// the token group (its all_gather of the counts, issued on `s`, on tensors of its device), and the rows
/// each chunk dispatches, in order (MoeEpChunk's send_rows and first_sent; recv_* are the
/// dispatch's to fill).
struct MoeEpPlan {
  std::vector<std::uint8_t> kept;                 ///< [T_r·k] 1: served
  std::vector<std::int64_t> tokens_per_expert;    ///< [E] this rank's served assignments
  std::vector<std::int64_t> routed_all;           ///< [E] all ranks' chosen assignments
  std::int64_t tokens_all = 0;                    ///< T_all
  std::vector<MoeEpChunk> chunks;                 ///< each chunk's rows
  std::vector<std::vector<std::int32_t>> counts;  ///< [C][E] each chunk's rows for each expert
  std::vector<std::int64_t> sent;                 ///< each dispatched row's assignment t·k + j
};

/// The plan for this rank's choices `expert` [T_r·k] (moe_route's), over the token group `tg`
/// (MoeTokenOrder `order`), an EP group of `ep_size` ranks and `chunks` chunks. `lane`: the
/// counts' span on `trace`.
MoeEpPlan moe_ep_plan(const MoeShape& m, std::span<const std::int32_t> expert, Communicator& tg,
                      int ep_size, std::int64_t chunks, const MoeTokenOrder& order, const Stream& s,
                      Lane lane, Trace& trace);

/// The MoE parameters as f32 tensors on one device, MoeWeights' seven (undefined where a rank
/// has none: no shared experts): router [H, E], w_gate and w_up [E/EP, H, FE], w_down
/// [E/EP, FE, H], shared [H, SF] and [SF, H].
using MoeTensors = MoeWeights<float, Tensor>;

/// This rank's forward on tensors: its tokens' output and what its backward needs.
struct MoeEpOpsForward {
  Tensor y;                              ///< [T_r, H]
  double aux_loss = 0.0;                 ///< this rank's part of L_aux
  std::vector<std::uint8_t> kept;        ///< [T_r·k] the capacity's verdicts
  std::vector<std::int64_t> routed_all;  ///< [E] assignments all ranks' tokens chose
  std::int64_t tokens_all = 0;           ///< T_all
  std::vector<MoeEpChunk> chunks;        ///< each chunk's exchanges
  Tensor logits, score;                  ///< [T_r, E]
  Tensor expert, weight;                 ///< [T_r, k] the choices (i32) and their gate weights
  Tensor slot;                    ///< [T_r, k] i32: each kept assignment's row in `out`, else −1
  Tensor sent_token;              ///< [S] i32: each dispatched row's token
  Tensor sent_weight;             ///< [S] its gate weight
  std::vector<Tensor> recv;       ///< per chunk [R_c, H]: the rows received
  std::vector<Tensor> gate;       ///< per chunk [R_c, FE]: the local experts' pre-activations
  std::vector<Tensor> up;         ///< per chunk [R_c, FE]
  Tensor out;                     ///< [S, H] the experts' outputs, back in sent order
  Tensor shared_gate, shared_up;  ///< [T_r, SF]
  /// The bytes of the float buffers it keeps (what saved_bytes reports).
  std::size_t bytes() const;
};

/// moe_ep_forward on tensors of w's device, f32: x [T_r, H], bias [E] or undefined, `s` the
/// compute stream of that device (the exchanges are issued on it). A chunked overlap (o.chunks > 1
/// with a lane) runs on the cpu only.
MoeEpOpsForward moe_ep_ops_forward(const MoeShape& m, const MoeTensors& w, const Tensor& x,
                                   const Tensor& bias, Communicator& ep, const Stream& s,
                                   Communicator* token_group = nullptr, const MoeEpOverlap& o = {},
                                   const MoeTokenOrder& order = {});

/// moe_ep_backward on tensors: dy [T_r, H] → the gradients (g.x [T_r, H] and the seven, shaped as
/// w's, zero where nothing flowed), as moe_ep_backward says (`tp`: the experts' width cut over
/// a TP group).
struct MoeTensorGrads {
  Tensor x;
  MoeTensors w;
};
MoeTensorGrads moe_ep_ops_backward(const MoeShape& m, const MoeTensors& w, const Tensor& x,
                                   const MoeEpOpsForward& f, const Tensor& dy, Communicator& ep,
                                   const Stream& s, Communicator* tp = nullptr,
                                   const MoeEpOverlap& o = {});

/// One rank's bytes and calls of an expert-parallel layer's forward and backward (the formula
/// above, in the communicator's accounting).
struct MoeEpTraffic {
  Traffic forward, backward;
  /// The part of `forward` over the token group: the all_gather of the counts (over the EP group
  /// itself unless moe_ep_forward was given a token group).
  Traffic counts;
};

/// The formula for rank r of an EP group: rows[s][d] = n_{s→d}, the kept assignments of rank s's
/// tokens to rank d's experts (EP × EP), `experts` = E, `row_bytes` = H · the element size.
/// Forward: the all_gather of E + 1 i32 counts (pieces·E + 1 for a MoeTokenOrder of `pieces`
/// runs a rank), the all_to_all_v of E i32, the dispatch of
/// Σ_d n_{r→d} rows and the combine of Σ_s n_{s→r} rows (4 calls); backward: the same two row
/// exchanges (2 calls). Bus bytes count what leaves the rank (d ≠ r, s ≠ r).
/// `token_ranks`: the size of the token group the counts are gathered over (0: the EP group).
/// `chunks` C (MoeEpOverlap): the same rows in C dispatches and C combines each way, and C
/// all_to_all_v of the E counts: 1 + 3·C calls forward and 2·C backward, 4·E·C bytes of counts.
MoeEpTraffic moe_ep_traffic(const std::vector<std::vector<std::uint64_t>>& rows, int r,
                            std::int64_t experts, std::uint64_t row_bytes, int token_ranks = 0,
                            int chunks = 1, std::int64_t pieces = 1);

/// n_{s→d} under perfectly balanced, dropless routing (what a dry run assumes): each of the EP
/// ranks' T_r tokens sends k rows, spread evenly over the EP ranks (T_r · k / EP each, which
/// must divide).
std::vector<std::vector<std::uint64_t>> moe_balanced_rows(int ep, std::int64_t tokens_per_rank,
                                                          std::int64_t topk);

}  // namespace tpx
