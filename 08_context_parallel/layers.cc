#include "08_context_parallel/layers.h"

#include <chrono>
#include <cstring>
#include <span>
#include <utility>

#include <fmt/format.h>

#include "07_fsdp_tp/flags.h"
#include "07_fsdp_tp/memory.h"
#include "08_context_parallel/flags.h"
#include "08_context_parallel/memory.h"
#include "common/check.h"
#include "common/ops.h"
#include "common/tp.h"
#include "common/trace.h"

namespace tpx::cp {
namespace {

/// The options stage 07 runs with on one CP rank: its part of the sequence, S / C tokens.
StageOptions local_options(const StageOptions& o, const Mesh& m) {
  StageOptions t = o;
  t.config.seq = o.config.seq / m.cp;
  return t;
}

/// lse [B, heads, S/C] of this rank, seen chunk-major: the B·heads·S/(2C) floats of chunk j.
/// The layout is this stage's own (only attention_backward reads lse).
Tensor lse_chunk(const Tensor& lse, int j) {
  const std::int64_t n = lse.numel() / 2;
  return lse.reshape({2, n}).slice0(j, j + 1).reshape({n});
}

/// [rows, B, X] ← the 2·n floats of a packed K/V buffer: part 0 is k, part 1 is v.
Tensor packed(const Tensor& buf, int part, const Tensor::Shape& shape) {
  const std::int64_t n = buf.numel() / 2;
  return buf.slice0(part * n, (part + 1) * n).reshape(shape);
}

// Under --dtype bf16 (DESIGN.md, "Mixed precision") q, k, v, the output and the gradients are
// stored bf16 and K/V move in bf16, but the chunk pairs are computed and merged in fp32: each
// pair's partial output and lse, the running merge and the dK/dV partial sums stay fp32, and
// each of the op's outputs is rounded to bf16 once, at the end, as every op of the recipe rounds
// its own. The pairs read q, k, v, dO and O as they are stored: on cuda the tensor-core kernels
// take bf16 operands and write fp32 partials (ops::attention_block_*), on the cpu the op reads
// fp32 copies of them (exact: every bf16 value is an fp32 value), made by
// ops::attention_block_operand once for all the pairs that read them: q, dO and O once per
// attention, each K/V block once per ring step (or gathered block), never once per pair.

/// Where an op accumulates its output `t` in fp32: t itself when it is f32, else a new fp32
/// tensor that round_into() rounds into t once.
Tensor accumulator(const Tensor& t) {
  return t.dtype() == DType::f32 ? t : Tensor::empty(t.shape(), DType::f32, t.device());
}

/// t ← the fp32 result `acc`: a copy, or the one rounding of a bf16 output. Nothing when acc is
/// t's own accumulator.
void round_into(const Tensor& acc, const Tensor& t) {
  if (acc.dtype() == t.dtype()) {
    if (acc.raw() != t.raw()) ops::copy(acc, t);
  } else {
    ops::cast(acc, t);
  }
}

/// Adds the time from its making to its end to `ms`, and one to `blocks`: the attention time of
/// one ring step (or one all-gather block, or Ulysses' whole attention), for --json.
class BlockTimer {
 public:
  BlockTimer(double& ms, std::uint64_t& blocks)
      : ms_(ms), blocks_(blocks), t0_(std::chrono::steady_clock::now()) {}
  ~BlockTimer() {
    ms_ +=
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
    ++blocks_;
  }
  BlockTimer(const BlockTimer&) = delete;
  BlockTimer& operator=(const BlockTimer&) = delete;

 private:
  double& ms_;
  std::uint64_t& blocks_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace

ContextParallel::ContextParallel(const RunContext& ctx, const Mesh& mesh, CpMethod method)
    : local_options_(local_options(ctx.options, mesh)),
      mesh_(mesh),
      method_(method),
      local_ctx_{local_options_, ctx.rank, ctx.world, ctx.trace},
      inner_(std::make_unique<fsdp::FsdpTp>(local_ctx_, mesh)),
      trace_(ctx.trace),
      device_(ctx.options.config.device),
      seq_(ctx.options.config.seq),
      cp_lane_(Stream::create(device_)) {
  CommOptions o = ctx.options.comm;
  o.group = mesh_.cp_group;
  cp_comm_ = make_communicator(o, device_);
}

ContextParallel::~ContextParallel() = default;

Sharding ContextParallel::sharding() const {
  Sharding s = inner_->sharding();
  s.cp = mesh_.cp;
  s.dimensions.push_back(memory_dimension(method_));  // CP attention buffers
  return s;
}

std::string ContextParallel::comm_name() const {
  // Stage 07's words without its own "mesh D × TP; " prefix: the groups' communicators.
  const std::string inner = inner_->comm_name();
  const std::size_t groups = inner.find("; ");
  return fmt::format("mesh D {} × CP {} × TP {} (cp-method {}); {}; cp: {}", mesh_.dp, mesh_.cp,
                     mesh_.tp, to_string(method_),
                     groups == std::string::npos ? inner : inner.substr(groups + 2),
                     cp_comm_->name());
}

// --- the data: this rank's chunks ----------------------------------------------------------------

void ContextParallel::shard_model(Model& m) {
  const BlockConfig& c = local_ctx_.options.config;  // S / C
  BlockConfig whole = c;
  whole.seq = seq_;
  whole.device = Device::cpu;
  const std::int64_t chunk = seq_ / (2 * mesh_.cp), rows = seq_ / mesh_.cp / mesh_.tp;
  auto mine = [&](bool target) {
    // The rank's S/C tokens, chunk i then chunk 2C−1−i, and of them its TP rank's S/(C·T) rows.
    const Tensor local = Tensor::empty({2 * chunk, c.batch, c.hidden});
    for (int j = 0; j < 2; ++j) {
      const std::int64_t first = chunk_of(mesh_.cp_index, j) * chunk;
      ops::copy(make_data(whole, target, first, first + chunk),
                local.slice0(j * chunk, (j + 1) * chunk));
    }
    const Tensor part = local.slice0(mesh_.tp_index * rows, (mesh_.tp_index + 1) * rows);
    return ops::to_device(part, c.device);
  };
  if (m.input.defined()) {
    m.input = mine(false);
    m.target = mine(true);
  }
  inner_->shard_model(m);  // the batch over DP, the parameters over DP×CP
}

TokenCut ContextParallel::token_cut(const BlockConfig& c) const {
  // The targets come from the global stream: a chunk's last token predicts the first of the
  // next chunk, which another rank holds (TokenStream cuts after choosing them).
  TokenCut cut = inner_->token_cut(c);
  cut.runs = sequence_runs(seq_ / mesh_.cp);
  return cut;
}

std::vector<SequenceRun> ContextParallel::sequence_runs(std::int64_t rows) const {
  const std::int64_t chunk = seq_ / (2 * mesh_.cp);
  TPX_CHECK(rows == 2 * chunk, "CP attention sees {} rows, not the rank's two chunks of {}", rows,
            chunk);
  return {{chunk, chunk_of(mesh_.cp_index, 0) * chunk},
          {chunk, chunk_of(mesh_.cp_index, 1) * chunk}};
}

// --- attention -----------------------------------------------------------------------------------

void ContextParallel::attend_block(const Tensor& q, const Tensor& k, const Tensor& v, int src,
                                   std::int64_t heads, const Tensor& out, const Tensor& lse) {
  const std::int64_t chunk = q.dim(0) / 2;
  const Tensor kw = ops::attention_block_operand(k), vw = ops::attention_block_operand(v);
  for (int i = 0; i < 2; ++i) {
    const Tensor qi = q.slice0(i * chunk, (i + 1) * chunk);
    const Tensor oi = out.slice0(i * chunk, (i + 1) * chunk), li = lse_chunk(lse, i);
    const Tensor part_out = Tensor::empty(qi.shape(), DType::f32, device_);
    const Tensor part_lse = Tensor::empty(li.shape(), DType::f32, device_);
    for (int j = 0; j < 2; ++j) {
      // Whole chunks: key chunk kc is visible to query chunk qc in full when kc < qc, masked
      // on the diagonal, and not at all when kc > qc (skipped).
      const std::int64_t qc = chunk_of(mesh_.cp_index, i), kc = chunk_of(src, j);
      if (kc > qc) continue;
      const Tensor kj = kw.slice0(j * chunk, (j + 1) * chunk);
      const Tensor vj = vw.slice0(j * chunk, (j + 1) * chunk);
      ops::attention_block_forward(qi, kj, vj, heads, part_out, part_lse, (qc - kc) * chunk);
      ops::attention_merge(oi, li.reshape({q.dim(1), heads, chunk}), part_out,
                           part_lse.reshape({q.dim(1), heads, chunk}), heads);
    }
  }
}

void ContextParallel::attend_block_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                            const Tensor& v, int src, const Tensor& out,
                                            const Tensor& lse, std::int64_t heads, const Tensor& dq,
                                            const Tensor& dk, const Tensor& dv) {
  const std::int64_t chunk = q.dim(0) / 2;
  const Tensor kw = ops::attention_block_operand(k), vw = ops::attention_block_operand(v);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      const std::int64_t qc = chunk_of(mesh_.cp_index, i), kc = chunk_of(src, j);
      if (kc > qc) continue;
      auto rows = [&](const Tensor& t, int c) { return t.slice0(c * chunk, (c + 1) * chunk); };
      ops::attention_block_backward(rows(dout, i), rows(q, i), rows(kw, j), rows(vw, j),
                                    rows(out, i), lse_chunk(lse, i), heads, rows(dq, i),
                                    rows(dk, j), rows(dv, j), (qc - kc) * chunk);
    }
}

Event ContextParallel::gather_kv(const Tensor& mine, const Tensor& all, const std::string& what) {
  const std::uint64_t booked = cp_comm_->book(CommOp::all_gather, what);
  return run_after_compute(cp_lane_, {mine, all}, [this, mine, all, what, booked] {
    TraceScope span(trace_, what, Lane::cp_comm);
    cp_comm_->all_gather(mine, all, cp_lane_, booked);
  });
}

Event ContextParallel::ring_hop(const Tensor& send, const Tensor& recv, const std::string& what) {
  const int next = (mesh_.cp_index + 1) % mesh_.cp,
            prev = (mesh_.cp_index + mesh_.cp - 1) % mesh_.cp;
  // Booked now, so that the flight recorder has it in the program's order on every rank; and
  // marked as queued on the lane (as stage 07 marks its gathers): when it was issued, whenever
  // the lane's thread gets to run it.
  const std::uint64_t booked = cp_comm_->book(CommOp::sendrecv, what);
  if (trace_.recording()) {
    const auto now = Trace::Clock::now();
    trace_.record(what + " queued", Lane::cp_comm, now, now, /*counted=*/false);
  }
  return run_after_compute(cp_lane_, {send, recv}, [this, send, recv, next, prev, what, booked] {
    TraceScope span(trace_, what, Lane::cp_comm);
    cp_comm_->sendrecv(send, next, recv, prev, cp_lane_, what, booked);
  });
}

void ContextParallel::all_to_all(const Tensor& send, const Tensor& recv, const std::string& what) {
  const int n = mesh_.cp, me = mesh_.cp_index;
  const std::int64_t part = send.numel() / n;
  auto block = [&](const Tensor& t, int r) { return t.slice0(r * part, (r + 1) * part); };
  ops::copy(block(send, me), block(recv, me));
  std::vector<std::pair<std::string, std::uint64_t>> steps;  // booked now, in program order
  for (int s = 1; s < n; ++s) {
    std::string name = fmt::format("{} step {}/{}", what, s, n - 1);
    const std::uint64_t booked = cp_comm_->book(CommOp::sendrecv, name);
    steps.emplace_back(std::move(name), booked);
  }
  run_after_compute(cp_lane_, {send, recv}, [this, send, recv, n, me, what, block, steps] {
    TraceScope span(trace_, what, Lane::cp_comm);
    for (int s = 1; s < n; ++s) {  // step s: to me + s, from me − s
      const int to = (me + s) % n, from = (me - s + n) % n;
      const auto& [name, booked] = steps[static_cast<std::size_t>(s - 1)];
      cp_comm_->sendrecv(block(send, to), to, block(recv, from), from, cp_lane_, name, booked);
    }
  }).wait(Stream(device_));
}

Tensor ContextParallel::seq_to_heads(const Tensor& x, const std::string& what) {
  const int n = mesh_.cp;
  const std::int64_t rows = x.dim(0), b = x.dim(1), cols = x.dim(2) / n, chunk = rows / 2;
  // Pack: block r = the columns of head part r, [S/C, B, X/C], on the run's device (cuda: a
  // kernel; the index map is common/column_blocks.h), in the activations' dtype.
  const Tensor send = Tensor::empty({n * rows * b * cols}, x.dtype(), device_);
  ops::split_columns(x, n, send);
  const Tensor recv = Tensor::empty(send.shape(), x.dtype(), device_);
  all_to_all(send, recv, what);
  // Block r holds CP rank r's two chunks: each goes to its place in the sequence.
  const Tensor full = Tensor::empty({n * rows, b, cols}, x.dtype(), device_);
  const std::int64_t per_chunk = chunk * b * cols;
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < 2; ++j)
      ops::copy(recv.slice0((2 * r + j) * per_chunk, (2 * r + j + 1) * per_chunk),
                full.slice0(chunk_of(r, j) * chunk, (chunk_of(r, j) + 1) * chunk));
  return full;
}

Tensor ContextParallel::heads_to_seq(const Tensor& x, const std::string& what) {
  const int n = mesh_.cp;
  const std::int64_t rows = x.dim(0) / n, b = x.dim(1), cols = x.dim(2), chunk = rows / 2;
  const std::int64_t per_chunk = chunk * b * cols;
  // Block r = CP rank r's two chunks of this rank's head part.
  const Tensor send = Tensor::empty({n * rows * b * cols}, x.dtype(), device_);
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < 2; ++j)
      ops::copy(x.slice0(chunk_of(r, j) * chunk, (chunk_of(r, j) + 1) * chunk),
                send.slice0((2 * r + j) * per_chunk, (2 * r + j + 1) * per_chunk));
  const Tensor recv = Tensor::empty(send.shape(), x.dtype(), device_);
  all_to_all(send, recv, what);
  // Block r holds head part r of this rank's rows: its columns (unpacked where they are).
  const Tensor local = Tensor::empty({rows, b, n * cols}, x.dtype(), device_);
  ops::join_columns(recv, n, local);
  return local;
}

void ContextParallel::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                        std::int64_t heads, const Tensor& out, const Tensor& lse,
                                        DType compute_type) {
  const int call = forward_calls_++;
  if (method_ == CpMethod::ulysses)
    return ulysses_forward(q, k, v, heads, out, lse, compute_type, call);
  // The partial outputs merge into an fp32 output (bf16: rounded into `out` once at the end);
  // the lse is fp32 in every recipe.
  const Tensor out32 = accumulator(out);
  ops::fill(out32, 0.0f);
  ops::fill(lse, -std::numeric_limits<float>::infinity());
  // q as every chunk pair reads it (the cpu: fp32), made once for all the blocks.
  const Tensor qw = ops::attention_block_operand(q);
  if (method_ == CpMethod::allgather)
    allgather_forward(qw, k, v, heads, out32, lse, call);
  else
    ring_forward(qw, k, v, heads, out32, lse, call);
  round_into(out32, out);
}

Tensor ContextParallel::pack_kv(const Tensor& k, const Tensor& v) const {
  // This rank's K/V block, packed into one buffer [k | v] so that each hop is one transfer; it
  // moves in the activations' dtype (bf16: half the bytes) and is read as it moves.
  const Tensor mine = Tensor::empty({2 * k.numel()}, k.dtype(), device_);
  ops::copy(k, packed(mine, 0, k.shape()));
  ops::copy(v, packed(mine, 1, k.shape()));
  return mine;
}

void ContextParallel::ulysses_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                      std::int64_t heads, const Tensor& out, const Tensor& lse,
                                      DType compute_type, int call) {
  const int n = mesh_.cp;
  // Whole sequence, heads / C of this rank's heads: the rank's own lse buffer holds
  // [B, heads / C, S], as many floats as [B, heads, S / C].
  const Tensor qh = seq_to_heads(q, fmt::format("cp q all-to-all (fwd {})", call));
  const Tensor kh = seq_to_heads(k, fmt::format("cp k all-to-all (fwd {})", call));
  const Tensor vh = seq_to_heads(v, fmt::format("cp v all-to-all (fwd {})", call));
  // The whole sequence's attention of these heads is complete here: its output is rounded to
  // bf16 once, by the fused op itself, before it moves back.
  const Tensor oh = Tensor::empty(qh.shape(), q.dtype(), device_);
  {
    TraceScope span(trace_, "attention fwd (whole sequence, heads / C)");
    const BlockTimer timer(attention_ms_, attention_blocks_);
    ops::attention_fused_forward(qh, kh, vh, heads / n, oh,
                                 lse.reshape({q.dim(1), heads / n, seq_}), compute_type);
  }
  ops::copy(heads_to_seq(oh, fmt::format("cp out all-to-all (fwd {})", call)), out);
}

void ContextParallel::allgather_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                        std::int64_t heads, const Tensor& out32, const Tensor& lse,
                                        int call) {
  const int n = mesh_.cp;
  const Stream compute(device_);
  const std::int64_t kv = k.numel();
  const Tensor all = Tensor::empty({n * 2 * kv}, k.dtype(), device_);
  gather_kv(pack_kv(k, v), all, fmt::format("cp K/V all-gather (fwd {})", call)).wait(compute);
  for (int r = 0; r < n; ++r) {
    TraceScope span(trace_, fmt::format("attention fwd: K/V of cp rank {}", r));
    const BlockTimer timer(attention_ms_, attention_blocks_);
    const Tensor block = all.slice0(r * 2 * kv, (r + 1) * 2 * kv);
    attend_block(q, packed(block, 0, k.shape()), packed(block, 1, k.shape()), r, heads, out32, lse);
  }
}

void ContextParallel::ring_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                   std::int64_t heads, const Tensor& out32, const Tensor& lse,
                                   int call) {
  const int n = mesh_.cp, me = mesh_.cp_index;
  const Stream compute(device_);
  // At step s the rank holds the block of cp rank (me − s) mod C, attends to it while the block
  // travels on to me + 1 and the next one arrives from me − 1.
  std::array<Tensor, 2> buf{pack_kv(k, v), Tensor::empty({2 * k.numel()}, k.dtype(), device_)};
  Event arrived;
  for (int s = 0; s < n; ++s) {
    const Tensor& held = buf[std::size_t(s % 2)];
    if (s > 0) arrived.wait(compute);
    if (s + 1 < n)
      arrived = ring_hop(held, buf[std::size_t((s + 1) % 2)],
                         fmt::format("cp K/V ring fwd {} hop {}/{}", call, s + 1, n - 1));
    const int src = (me - s + n) % n;
    TraceScope span(
        trace_, fmt::format("attention fwd ring step {}/{} (K/V of cp rank {})", s + 1, n, src));
    const BlockTimer timer(attention_ms_, attention_blocks_);
    attend_block(q, packed(held, 0, k.shape()), packed(held, 1, k.shape()), src, heads, out32, lse);
  }
}

void ContextParallel::attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                         const Tensor& v, const Tensor& out, const Tensor& lse,
                                         std::int64_t heads, const Tensor& dq, const Tensor& dk,
                                         const Tensor& dv, DType compute_type) {
  const int call = backward_calls_++;
  const Grads grads{dq, dk, dv};
  if (method_ == CpMethod::ulysses)
    return ulysses_backward(dout, q, k, v, out, lse, heads, grads, compute_type, call);
  // The pairs read dO, q, K/V and O as stored; dq sums over the blocks in fp32 and dK/dV's
  // partial sums stay fp32 until they are complete, each rounded into its bf16 output once.
  const Tensor dq32 = accumulator(dq);
  ops::fill(dq32, 0.0f);
  // dO, q and O as every chunk pair reads them (the cpu: fp32), made once for all the blocks.
  const Tensor dow = ops::attention_block_operand(dout), qw = ops::attention_block_operand(q),
               ow = ops::attention_block_operand(out);
  const Tensor dkv = method_ == CpMethod::allgather
                         ? allgather_backward(dow, qw, k, v, ow, lse, heads, dq32, call)
                         : ring_backward(dow, qw, k, v, ow, lse, heads, dq32, call);
  round_into(packed(dkv, 0, k.shape()), dk);
  round_into(packed(dkv, 1, k.shape()), dv);
  round_into(dq32, dq);
}

void ContextParallel::ulysses_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                       const Tensor& v, const Tensor& out, const Tensor& lse,
                                       std::int64_t heads, const Grads& grads, DType compute_type,
                                       int call) {
  const int n = mesh_.cp;
  // The forward kept the sequence-sharded tensors only: q, k, v and the output go to the
  // head-sharded layout again, with dO; the gradients come back.
  auto to_heads = [&](const Tensor& t, const char* name) {
    return seq_to_heads(t, fmt::format("cp {} all-to-all (bwd {})", name, call));
  };
  const Tensor qh = to_heads(q, "q"), kh = to_heads(k, "k"), vh = to_heads(v, "v");
  const Tensor oh = to_heads(out, "out"), doh = to_heads(dout, "dout");
  // Each rank's gradients are whole here (every query of its heads): rounded once by the fused
  // op, they move back in the activations' dtype.
  const Tensor dqh = Tensor::empty(qh.shape(), grads.dq.dtype(), device_);
  const Tensor dkh = Tensor::empty(kh.shape(), grads.dk.dtype(), device_);
  const Tensor dvh = Tensor::empty(vh.shape(), grads.dv.dtype(), device_);
  {
    TraceScope span(trace_, "attention bwd (whole sequence, heads / C)");
    const BlockTimer timer(attention_ms_, attention_blocks_);
    ops::attention_fused_backward(doh, qh, kh, vh, oh, lse.reshape({q.dim(1), heads / n, seq_}),
                                  heads / n, dqh, dkh, dvh, compute_type);
  }
  ops::copy(heads_to_seq(dqh, fmt::format("cp dq all-to-all (bwd {})", call)), grads.dq);
  ops::copy(heads_to_seq(dkh, fmt::format("cp dk all-to-all (bwd {})", call)), grads.dk);
  ops::copy(heads_to_seq(dvh, fmt::format("cp dv all-to-all (bwd {})", call)), grads.dv);
}

Tensor ContextParallel::allgather_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                           const Tensor& v, const Tensor& out, const Tensor& lse,
                                           std::int64_t heads, const Tensor& dq32, int call) {
  const int n = mesh_.cp;
  const Stream compute(device_);
  // K and V gathered again (the forward kept only this rank's), every block's dK/dV computed
  // here, then reduce-scattered in fp32: each rank receives the sum over CP of its own block's.
  const std::int64_t kv = k.numel();
  const Tensor all = Tensor::empty({n * 2 * kv}, k.dtype(), device_);
  const Tensor dall = Tensor::empty({n * 2 * kv}, DType::f32, device_);
  ops::fill(dall, 0.0f);  // every block's dK/dV is added into it
  const Tensor dmine = Tensor::empty({2 * kv}, DType::f32, device_);
  gather_kv(pack_kv(k, v), all, fmt::format("cp K/V all-gather (bwd {})", call)).wait(compute);
  for (int r = 0; r < n; ++r) {
    const Tensor dblock = dall.slice0(r * 2 * kv, (r + 1) * 2 * kv);
    TraceScope span(trace_, fmt::format("attention bwd: K/V of cp rank {}", r));
    const BlockTimer timer(attention_ms_, attention_blocks_);
    const Tensor block = all.slice0(r * 2 * kv, (r + 1) * 2 * kv);
    attend_block_backward(dout, q, packed(block, 0, k.shape()), packed(block, 1, k.shape()), r, out,
                          lse, heads, dq32, packed(dblock, 0, k.shape()),
                          packed(dblock, 1, k.shape()));
  }
  const std::string what = fmt::format("cp dK/dV reduce-scatter (bwd {})", call);
  const std::uint64_t booked = cp_comm_->book(CommOp::reduce_scatter, what);
  run_after_compute(cp_lane_, {dall, dmine}, [this, dall, dmine, what, booked] {
    TraceScope span(trace_, what, Lane::cp_comm);
    cp_comm_->reduce_scatter(dall, dmine, cp_lane_, booked);
  }).wait(compute);
  return dmine;
}

Tensor ContextParallel::ring_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                      const Tensor& v, const Tensor& out, const Tensor& lse,
                                      std::int64_t heads, const Tensor& dq32, int call) {
  const int n = mesh_.cp, me = mesh_.cp_index;
  const Stream compute(device_);
  // The K/V blocks go round again. The dK/dV partial of the block held at step s is computed
  // here into a fresh buffer, the partial that the previous ranks accumulated for the same
  // block (arriving from me − 1) is added, and the sum travels on with the block; after the
  // last step one more hop brings each block's complete dK/dV to its owner.
  // K/V travel in the activations' dtype, the dK/dV partial sums in fp32.
  const std::int64_t kv = k.numel();
  std::array<Tensor, 2> buf{pack_kv(k, v), Tensor::empty({2 * kv}, k.dtype(), device_)};
  std::array<Tensor, 2> dbuf{Tensor::empty({2 * kv}, DType::f32, device_),
                             Tensor::empty({2 * kv}, DType::f32, device_)};
  Tensor incoming = Tensor::empty({2 * kv}, DType::f32, device_);
  Event kv_arrived, d_arrived;
  for (int s = 0; s < n; ++s) {
    const Tensor& held = buf[std::size_t(s % 2)];
    if (s > 0) kv_arrived.wait(compute);
    if (s + 1 < n)
      kv_arrived = ring_hop(held, buf[std::size_t((s + 1) % 2)],
                            fmt::format("cp K/V ring bwd {} hop {}/{}", call, s + 1, n - 1));
    const int src = (me - s + n) % n;
    const Tensor& dheld = dbuf[std::size_t(s % 2)];
    {
      TraceScope span(
          trace_, fmt::format("attention bwd ring step {}/{} (K/V of cp rank {})", s + 1, n, src));
      const BlockTimer timer(attention_ms_, attention_blocks_);
      ops::fill(dheld, 0.0f);
      attend_block_backward(dout, q, packed(held, 0, k.shape()), packed(held, 1, k.shape()), src,
                            out, lse, heads, dq32, packed(dheld, 0, k.shape()),
                            packed(dheld, 1, k.shape()));
    }
    if (s > 0) {  // the partial of the same block that the previous ranks accumulated
      d_arrived.wait(compute);
      ops::accumulate(incoming, dheld);
    }
    // The dK/dV of block src go on to me + 1 (at the last step: home), and the partial for the
    // next block (at the last step: this rank's own, complete) arrives from me − 1.
    const Tensor next_in = Tensor::empty({2 * kv}, DType::f32, device_);
    d_arrived =
        ring_hop(dheld, next_in, fmt::format("cp dK/dV ring bwd {} hop {}/{}", call, s + 1, n));
    incoming = next_in;
  }
  d_arrived.wait(compute);
  return incoming;
}

// --- reporting -----------------------------------------------------------------------------------

Tensor ContextParallel::gather_activation(const Tensor& local) {
  // Stage 07 puts this CP rank's [S/C, B, H] together (TP and DP); then the CP ranks' chunks go
  // back to their places in the sequence.
  const Tensor mine = ops::to_device(inner_->gather_activation(local), Device::cpu);
  const std::int64_t s = mine.dim(0), chunk = s / 2;
  const std::size_t bytes = mine.nbytes(), row = bytes / std::size_t(s);
  const Tensor all = Tensor::empty({mesh_.cp * s, mine.dim(1), mine.dim(2)}, mine.dtype());
  // Through the CP communicator's report lane, not a bare MPI call: a rank that never joins is
  // named by the watchdog instead of leaving its peers waiting here forever.
  cp_comm_->all_gather_report(std::span(static_cast<const std::byte*>(mine.raw()), bytes),
                              std::span(static_cast<std::byte*>(all.raw()), all.nbytes()),
                              "activation gather for --check/--dump");
  const Tensor full = Tensor::empty({mesh_.cp * s, mine.dim(1), mine.dim(2)}, mine.dtype());
  for (int r = 0; r < mesh_.cp; ++r)
    for (int j = 0; j < 2; ++j)
      std::memcpy(static_cast<std::byte*>(full.raw()) + std::size_t(chunk_of(r, j) * chunk) * row,
                  static_cast<const std::byte*>(all.raw()) + std::size_t(r * s + j * chunk) * row,
                  std::size_t(chunk) * row);
  return full;
}

CommStats ContextParallel::take_comm_stats() {
  CommStats s = inner_->take_comm_stats();
  s.add_group("cp", cp_comm_->take_stats());
  s.add_time("cp_attention", std::exchange(attention_ms_, 0.0),
             std::exchange(attention_blocks_, 0));
  return s;
}

void ContextParallel::synchronize() {
  inner_->synchronize();
  cp_lane_.synchronize();
}

void check_context_parallel(const RunContext& ctx, const Mesh& mesh) {
  const BlockConfig& c = ctx.options.config;
  const CpMethod method = ctx.options.flags<ContextParallelFlags>().method();
  const int dp = mesh.dp, cp = mesh.cp;
  if (c.batch % dp != 0)
    throw ConfigError(fmt::format(
        "--dp {} must divide --batch {}: each data-parallel replica trains B / D sequences", dp,
        c.batch));
  if (cp == 1) {
    check_tp_split(c, mesh.tp, /*sequence=*/true);
    return;
  }
  if (c.seq % (2 * cp * mesh.tp) != 0)
    throw ConfigError(
        mesh.tp == 1
            ? fmt::format("--seq {} must be divisible by 2·C = {}: the sequence is cut into 2C "
                          "chunks, CP rank i holding chunks i and 2C-1-i",
                          c.seq, 2 * cp)
            : fmt::format("--seq {} must be divisible by 2·C·T = {}: the sequence is cut into 2C "
                          "chunks, and each CP rank's two chunks split over its {} TP ranks",
                          c.seq, 2 * cp * mesh.tp, mesh.tp));
  if (c.attention != Attention::fused)
    throw ConfigError(
        method == CpMethod::ulysses
            ? std::string("--cp-method ulysses needs --attention fused: its all-to-alls run around "
                          "the fused attention (the block calls the naive kernel outside the CP "
                          "hooks, on the rank's own tokens alone)")
            : fmt::format("--cp-method {} needs --attention fused: it merges the fused kernel's "
                          "partial outputs by their log-sum-exp (the naive kernel keeps no lse)",
                          to_string(method)));
  if (method == CpMethod::ulysses && c.kv_heads_or_heads() % (cp * mesh.tp) != 0)
    throw ConfigError(fmt::format(
        "--cp-method ulysses needs the {} KV heads to split over C·T = {} ranks: the all-to-all "
        "gives every rank whole KV heads of the whole sequence (use ring or allgather)",
        c.kv_heads_or_heads(), cp * mesh.tp));
  BlockConfig local = c;
  local.seq = c.seq / cp;
  check_tp_split(local, mesh.tp, /*sequence=*/true);
}

namespace {

/// The mesh of ctx's job (--dp default 1, --cp default 2 when the ranks are even), checked.
/// Collective.
Mesh checked_mesh(const RunContext& ctx) {
  const int given_dp = ctx.options.flags<fsdp::DataParallelFlags>().dp;
  const int given_cp = ctx.options.flags<ContextParallelFlags>().cp;
  const int dp = mesh_degree(given_dp, MeshFlag::cp, MeshFlag::dp, ctx.world);
  const int cp = mesh_degree(given_cp, MeshFlag::cp, MeshFlag::cp, ctx.world);
  // A D·C that does not divide the ranks, named as the user gave it, before any group is made.
  if (std::string p =
          Mesh::problem(ctx.world, dp, cp, 1, {.dp = given_dp != 0, .cp = given_cp != 0});
      !p.empty())
    throw ConfigError(p);
  Mesh mesh = Mesh::make(dp, cp);
  check_context_parallel(ctx, mesh);
  return mesh;
}

/// Stage 07 alone at C = 1, else CP around it.
std::unique_ptr<Parallelism> build(const RunContext& ctx, Mesh mesh) {
  if (mesh.cp == 1) return std::make_unique<fsdp::FsdpTp>(ctx, std::move(mesh));
  return std::make_unique<ContextParallel>(ctx, mesh,
                                           ctx.options.flags<ContextParallelFlags>().method());
}

}  // namespace

std::unique_ptr<Parallelism> make_context_parallel(const RunContext& ctx) {
  return build(ctx, checked_mesh(ctx));
}

std::unique_ptr<Parallelism> make_context_parallel_on(const RunContext& ctx, Mesh mesh) {
  check_context_parallel(ctx, mesh);
  return build(ctx, std::move(mesh));
}

StagePlan plan_context_parallel(const RunContext& ctx) {
  const Mesh mesh = checked_mesh(ctx);
  const bool cp = mesh.cp > 1;
  const CpMethod method = ctx.options.flags<ContextParallelFlags>().method();
  const MeshTraffic t = mesh_traffic(ctx.options.config, mesh.dp, mesh.cp, mesh.tp, method);
  StagePlan p;
  p.sharding = {
      .rank = mesh.tp_index,
      .world = mesh.tp,
      .weights = true,
      .sequence = true,
      .dp = mesh.dp,
      .cp = mesh.cp,
      .dp_cp_index = mesh.dp_cp_index(),
      // as the Parallelism's sharding(): stage 07's FSDP inside, then CP
      .dimensions = {fsdp::memory_dimension(mesh.dp_cp_index() == 0), memory_dimension(method)}};
  p.traffic = t.total();
  p.groups = {
      {.name = "cp", .label = "cp group", .traffic = t.cp},
      {.name = "dp", .label = t.cp.calls > 0 ? "dp×cp group" : "dp group", .traffic = t.dp}};
  p.comm = cp ? fmt::format("mesh D {} × CP {} × TP {} (cp-method {}) (dry run)", mesh.dp, mesh.cp,
                            mesh.tp, to_string(method))
              : fmt::format("mesh D {} × TP {} (dry run)", mesh.dp, mesh.tp);
  return p;
}

}  // namespace tpx::cp
