// How much memory one rank needs, computed from the config before any of it is taken, so that a
// run that cannot fit is refused at start-up instead of failing (or swapping) half-way.
//
// The estimate is the high-water mark of the bytes the run takes through allocator_for(device)
// (what the step table's "peak" column measures), as a sum of named terms:
//   parameters, gradients   every layer's nine tensors, this rank's shards (param_local_shape)
//   saved activations       what forward keeps for backward, all L layers, exactly as
//                           BlockActivations::bytes() counts it (the chapters' formula);
//                           under --recompute what each layer keeps plus the largest
//                           recompute's remade tensors (common/memory.cc's table)
//   target                  the loss's T, this rank's part (the input x is layer 0's saved x)
//   largest temporaries     what else is alive at the peak: the output and its gradient, and
//                           the block backward's own tensors at their fullest (or, with long
//                           sequences and naive attention, a forward re-allocating a layer's
//                           probabilities; fused attention keeps only [B, NH/N, S]; under
//                           full recompute, a block's forward run again inside backward)
//   weight copies, state    bf16 compute copies of the matrices, AdamW's moments, FP8 weights
// and then the terms of the stages' own dimensions of the mesh (Sharding::dimensions,
// common/memory_terms.h): FSDP's unsharded layers and, on the cpu backend, the MPI
// reduce-scatter's staging on the first rank of a DP×CP group (07_fsdp_tp/memory.cc), CP's
// attention buffers (08_context_parallel/memory.cc), and a pipeline's buffers and the two host
// terms that grow with M and B (09_pipeline_parallel/memory.cc). The total is held against the
// process's own high-water mark (--json's host_peak_bytes − host_baseline_bytes, every rank):
// on the cpu backend the host allocator keeps malloc from holding freed tensors' pages
// (common/tensor.cc), so what the allocator frees leaves the process.
// Every size is computed with checked arithmetic (checked.h): sizes too large for 64 bits throw
// SizeOverflow, never a wrapped, small-looking number. It is pure arithmetic, so absurd configs
// are refused at once.
//
// Not counted: the CUDA context, cuBLAS / NCCL workspaces, the caching allocator's rounding to
// size classes, and the CPU attention's scratch (naive backward: an S×S matrix; fused: blocks of
// 128×128 scores); on the host, the blocks under 64 KiB malloc keeps, MPI's and the comm lanes'
// own pages (a per-thread malloc arena of about 130 KiB each) and the touched part of thread
// stacks; these are small or outside its view.
//
// defines: tpx::MemoryTerm, tpx::MemoryEstimate, tpx::estimate_training_memory(),
//          tpx::snapshot_bytes(), tpx::HostMemory, tpx::host_memory(),
//          tpx::reset_host_peak() (and, through units.h, tpx::bytes_text())
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.h"
#include "model.h"
#include "units.h"

namespace tpx {

/// The memory estimate's terms of the language model's ends (--task lm): the embedding, the
/// output layer with the final gain, the head's logits moment, the token ids.
inline constexpr const char* kLmEmbeddingTerm = "embedding";
inline constexpr const char* kLmOutputTerm = "output layer";
inline constexpr const char* kLmLogitsTerm = "logits";
inline constexpr const char* kLmTokensTerm = "tokens";

/// One named part of an estimate.
struct MemoryTerm {
  std::string name;  ///< e.g. "parameters", "saved activations"
  std::uint64_t bytes = 0;
};

/// A rank's peak memory as a sum of named terms.
struct MemoryEstimate {
  std::vector<MemoryTerm> terms;

  /// The sum of the terms; throws SizeOverflow if it does not fit in 64 bits.
  std::uint64_t total() const;
  /// The largest term (the first of equals); throws tpx::Error when there are no terms.
  const MemoryTerm& biggest() const;
  /// The term named `name`; throws tpx::Error when there is none.
  const MemoryTerm& term(const std::string& name) const;
  MemoryTerm& term(const std::string& name);
  /// Removes the term named `name`, if there is one.
  void remove(const std::string& name);
  /// One line, the total and each term in the total's unit, e.g.
  /// "33.6 MiB = parameters 8.0 + gradients 8.0 + saved activations 12.0 + ...".
  std::string describe() const;
};

/// This rank's peak bytes through allocator_for(c.device) while train() runs (without the
/// first-step snapshot), for a rank holding the part of the model `s` describes: stage 01
/// Sharding{}, stage 02 weights split over s.world ranks, stage 03 weights and sequence split;
/// stages 07-09 add their dimensions' terms through s.dimensions, in its order.
/// Expects a config that validate() accepts and that s.world divides where `s` splits (heads,
/// ffn, and seq with sequence parallelism; tpx::Error otherwise). Throws SizeOverflow when a
/// count does not fit in 64 bits.
MemoryEstimate estimate_training_memory(const BlockConfig& c, const Sharding& s);

/// Host bytes of the first-step snapshot rank 0 keeps for --check and --dump: full, unsharded
/// fp32 copies of the input, target, output and input gradient, and of every layer's parameters
/// and gradients. Host memory whatever the device (add it to a cpu estimate; on cuda it is
/// taken from the host). Throws SizeOverflow when it does not fit in 64 bits.
std::uint64_t snapshot_bytes(const BlockConfig& c);

/// This process's resident memory, as the kernel counts it (/proc/self/status): every page it
/// touched, the allocator's and everyone else's (MPI, BLAS, the binary, malloc's own books).
struct HostMemory {
  std::uint64_t rss = 0;   ///< VmRSS: resident now
  std::uint64_t peak = 0;  ///< VmHWM: the high-water mark of VmRSS (since the last reset)
};

/// This process's VmRSS and VmHWM; zeros where /proc is not there.
HostMemory host_memory();

/// Sets VmHWM back to VmRSS (/proc/self/clear_refs, Linux 4.0+), so that the next high-water
/// mark is that of what runs after; false where the kernel does not allow it (then VmHWM keeps
/// the earlier peak).
bool reset_host_peak();

}  // namespace tpx
