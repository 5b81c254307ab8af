// Checkpoints (DESIGN.md, "Checkpoints"): --save DIR writes DIR/step-<N>/, --resume DIR reads it
// back, on this mesh or another one.
//
// A checkpoint is a directory DIR/step-<N>/ with one shard file per rank (rank-<r>.bin: raw
// little-endian fp32 bytes, one tensor part after another) and one index.json that names every
// tensor's global shape and dtype and, for each shard, its file, byte offset, box (start and
// length per dim in the global tensor) and CRC-32 per chunk of kCheckpointChunkBytes. The boxes
// come from the cut that builds the model (param_local_shape, param_offset, vocab_shard in
// common/model.h): a checkpoint records where each rank's part lies, it does not describe the cut
// a second time. Loading on another mesh is reading another cut of the same global tensors: each
// rank asks the cut for the boxes it now holds and reads, of every shard, the chunks that hold the
// box it shares with that shard (overlap()), verifying their checksums.
//
// Saving is atomic: every rank writes its file into DIR/step-<N>.tmp/ (a temporary name, fsync,
// rename); after a barrier rank 0 writes index.json the same way, renames the directory to
// step-<N> and fsyncs DIR. Only a step-<N> directory holding index.json is a checkpoint: a save
// that died on the way leaves a step-<N>.tmp that --resume ignores.
//
// defines: tpx::crc32(), tpx::IndexRange, tpx::overlap(), tpx::kCheckpointVersion,
//          tpx::kCheckpointChunkBytes, tpx::StatePart, tpx::state_parts(),
//          tpx::checkpoint_file_bytes(),
//          tpx::checkpoint_flag_problem(), tpx::CheckpointSnapshot, tpx::snapshot_state(),
//          tpx::save_checkpoint(), tpx::AsyncCheckpointWriter, tpx::load_checkpoint()
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "check.h"
#include "config.h"
#include "model.h"
#include "tensor.h"

namespace tpx {

// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320, initial value and final xor 0xFFFFFFFF) of
// `n` bytes. `crc` continues an earlier call: crc32(b, n2, crc32(a, n1)) is the CRC of a then b,
// so a shard written in pieces has the checksum of its whole bytes.
std::uint32_t crc32(const void* data, std::size_t n, std::uint32_t crc = 0);

// One dimension of the part of a global tensor a shard covers: indices [start, start + length).
struct IndexRange {
  std::int64_t start = 0;
  std::int64_t length = 0;
  bool operator==(const IndexRange&) const = default;
};

// The box two parts of one global tensor share, dimension by dimension, or nothing when they are
// disjoint (or their ranks differ). Reshard reads, of each shard, the box it shares with the part
// a rank now owns.
std::optional<std::vector<IndexRange>> overlap(const std::vector<IndexRange>& a,
                                               const std::vector<IndexRange>& b);

/// The index's format version this program writes and the newest it reads.
inline constexpr int kCheckpointVersion = 1;
/// The bytes each CRC-32 of a shard covers (the last chunk of a shard may be shorter): a rank
/// that reads part of a shard verifies the chunks it reads.
inline constexpr std::int64_t kCheckpointChunkBytes = std::int64_t(1) << 20;

/// One tensor of the training state as the cut places it on one rank.
struct StatePart {
  std::string name;                 ///< "layers.0.wq", "embedding", "layers.0.wq.adamw_m", ...
  std::vector<std::int64_t> shape;  ///< the global tensor's (the vocabulary unpadded)
  std::vector<std::int64_t> local;  ///< the rank's tensor's (the vocabulary padded)
  /// The part of the global tensor the rank holds, at the origin of its local tensor (empty
  /// lengths: none, a rank whose vocabulary range is all padding).
  std::vector<IndexRange> box;
  bool saved = false;  ///< this rank writes it: a replicated tensor only on rank 0
};

/// Every tensor of the training state where the cut of (c, s) places it: the fp32 master of
/// every layer parameter (layer by layer, Param order), the language model's embedding, norm_f
/// and w_out (--task lm), then under --optimizer adamw the first moments of all of them and the
/// second moments. Of the layers and ends s holds (a pipeline stage's: Sharding::layers,
/// embedding, head), each at the TP cut and, over a DP×CP group of D·C > 1 ranks, FSDP's cut of
/// dim 0 (Sharding::dp_cp_index).
std::vector<StatePart> state_parts(const BlockConfig& c, const Sharding& s);

/// The bytes of the shard file (rank-R.bin) that a save of (c, s) writes on the rank cut as
/// `s`: the boxes of its saved state_parts(), 4 bytes an element, as the save packs them (the
/// index.json beside the files is not counted). --dry-run gathers every rank's.
std::int64_t checkpoint_file_bytes(const BlockConfig& c, const Sharding& s);

/// --save / --save-every / --resume as parsed (c.checkpoint, resume_dir the flag's DIR): one
/// sentence for the first that does not fit, nothing when they do. Resolves --resume DIR to the
/// checkpoint it names (DIR itself when it holds an index.json, else its step-N with the
/// largest N that does) and checks its index against the run before anything is allocated:
/// the format version, every tensor's global shape, the config the shapes and the state depend
/// on (task, dtype, optimizer, seed, data), every shard file's presence and size, and that the
/// run's --steps goes past the checkpoint's step. Sets c.checkpoint.resume_dir / resume_step.
std::optional<std::string> checkpoint_flag_problem(BlockConfig& c);

/// What a save writes: this rank's saved parts of the state (state_parts(c, s) order; empty for
/// a part it does not save), packed box by box in host memory, so that training may go on while
/// they are written; the step, and the checkpoint directory it becomes.
struct CheckpointSnapshot {
  std::int64_t step = 0;
  std::filesystem::path dir;  ///< c.checkpoint.save_dir/step-(step)
  std::vector<std::vector<float>> packed;
};

/// This rank's part of `state` (state_parts(c, s) order, its tensors on any device) after `step`
/// steps, copied to the host. Not collective.
CheckpointSnapshot snapshot_state(const BlockConfig& c, const Sharding& s,
                                  const std::vector<const Tensor*>& state, std::int64_t step);

/// A save that failed on some rank (a shard file or the index not written: a full disk, a
/// directory gone), thrown on every rank with the same message, the lowest failing rank's: the
/// run stops with that one line, exit 1 on every rank, and the previous checkpoints stay whole.
class SaveError : public Error {
 public:
  using Error::Error;
};

/// Collective over MPI_COMM_WORLD (every rank of the job, this one cut as `s`): writes
/// `snapshot` as c.checkpoint.save_dir/step-(step)/ by the atomic protocol above. Throws
/// SaveError naming the file on a failed write. Returns the new checkpoint's directory.
std::filesystem::path save_checkpoint(const BlockConfig& c, const Sharding& s,
                                      const CheckpointSnapshot& snapshot);

/// --async-save: each save written by a thread of its own, over a communicator of its own (a
/// duplicate of MPI_COMM_WORLD), while the steps go on. Made by every rank together (collective).
class AsyncCheckpointWriter {
 public:
  AsyncCheckpointWriter();
  ~AsyncCheckpointWriter();  ///< waits for a save in flight (call wait() to see its error)
  AsyncCheckpointWriter(const AsyncCheckpointWriter&) = delete;
  AsyncCheckpointWriter& operator=(const AsyncCheckpointWriter&) = delete;
  /// Waits for the save in flight (wait()), then starts writing `snapshot`.
  void start(const BlockConfig& c, const Sharding& s, CheckpointSnapshot snapshot);
  /// Waits for the save in flight; throws what it threw if it failed (a SaveError, the same on
  /// every rank, when a file could not be written).
  void wait();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Reads this rank's part of every tensor of `state` (state_parts(c, s) order) from the checkpoint
/// c.checkpoint.resume_dir, chunks verified by their CRC-32: empty on success, else one sentence
/// naming the file, the tensor and what is wrong (the tensors are then partly overwritten: the
/// caller stops). Not collective.
std::string load_checkpoint(const BlockConfig& c, const Sharding& s,
                            const std::vector<Tensor*>& state);

}  // namespace tpx
