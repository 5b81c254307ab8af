#include "stage.h"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "agree.h"
#include "check.h"
#include "checked.h"
#include "checkpoint.h"
#include "comm/watchdog.h"
#include "data.h"
#include "flops.h"
#include "generate.h"
#include "memory.h"
#include "npy.h"
#include "ops.h"
#include "output.h"
#include "placement.h"
#include "scaled_gemm_plan.h"
#include "tokenizer.h"
#include "trainer.h"

namespace tpx {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

/// MPI for the lifetime of main(); works with and without mpirun.
class MpiSession {
 public:
  MpiSession(int& argc, char**& argv) {
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &world_);
  }
  ~MpiSession() { MPI_Finalize(); }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  int rank() const { return rank_; }
  int world() const { return world_; }

 private:
  int rank_ = 0, world_ = 1;
};

/// Exit codes of a stage executable (also in --help's footer).
constexpr int kExitFail = 1;      ///< --check FAIL, an output not written, a fault flag not seen
constexpr int kExitConfig = 2;    ///< bad input or a config that cannot run here
constexpr int kExitDiverged = 3;  ///< a loss or gradient norm became NaN or infinite

/// The words of an agreed stop: the first stopping rank's message, naming that rank unless every
/// rank stopped for the same reason.
std::string verdict_text(const StartVerdict& v, int world) {
  return world > 1 && !v.unanimous ? fmt::format("rank {}: {}", v.rank, v.message) : v.message;
}

/// Ends the start-up of every rank together: if `problem` is non-empty on any rank, every rank
/// throws ConfigError with the first such rank's problem (named by rank when not all agree).
void stop_if_any_rank(const std::string& problem, int world) {
  const StartVerdict v = agree_to_start(!problem.empty(), kExitConfig, problem);
  if (!v.stop) return;
  throw ConfigError(verdict_text(v, world));
}

/// What the speed columns need: this rank's GEMM FLOPs per step and the device's bf16 peak.
struct Speed {
  double flops_per_rank = 0;
  double peak_tflops = 0;  ///< measured; 0 on the cpu (no TFLOP/s / MFU columns there)
  bool gpu() const { return peak_tflops > 0; }
  double tflops(double ms) const { return ms > 0 ? flops_per_rank / (ms * 1e-3) / 1e12 : 0.0; }
};

/// --check tolerance under --dtype bf16 (DESIGN.md, "Mixed precision"). bf16 keeps 8 significant
/// bits, so each rounding to nearest even changes a value by at most the unit roundoff
/// u = 2^-8 ≈ 3.9e-3 of itself. The recipe rounds once at every op's output and every weight's
/// compute copy: a value of the block's output or of a gradient lies downstream of some 10–25
/// roundings per layer (x, h, q/k/v, a, the Wo product, x2, h2, gate/up, s, the Wd product, and
/// the same again backward), each perturbing it by ≤ u times the sensitivity of what follows.
/// Independent roundings add in quadrature, √25·u ≈ 5u; measured on every stage at N = 1–4 at
/// the default config the largest relative error (max |got − want| / max |want|) is 1–3u. A bug
/// (a dropped term, a wrong shard, a skipped reduction) is off by O(1). 8u = 2^-5 separates the
/// two with room for deeper stacks.
constexpr double kBf16CheckRtol = 0x1p-5;
/// FP8 (stage 06) against fp32: E4M3 keeps 3 mantissa bits (relative rounding up to 2⁻⁴), E5M2 2
/// bits, so elementwise errors of several percent are the format, not a bug. --check accepts the
/// first-step output within 0.1 of the reference's scale, every gradient at cosine similarity ≥
/// 0.98 with the reference's, and each loss within 2 %; a wrong schedule or scale is far outside.
constexpr CheckTolerance kFp8Check{.rtol = 0.1, .cosine = 0.98, .loss_rtol = 0.02};
/// Under --fp8-recipe rowwise, block128, mxfp8 or nvfp4 the reference emulates the recipe
/// (reference.h, LowpEmulation: the same operands quantized the same way, multiplied in double,
/// and every activation and gradient rounded to bf16 where the stage stores one). What still
/// separates the two is fp32 against double arithmetic between those roundings: where the two
/// round a value to different bf16 neighbours, or the values lie on either side of a rounding
/// boundary of the format, the element quantizes one step (2^-3 relative, E4M3; 2^-2, E5M2)
/// away, and each such flip's difference feeds the next GEMM's quantization, which flips more. The
/// tolerance stays FP8's.
///
/// nvfp4's E2M1 elements step by up to 2^-1 relative (1 → 1.5 → 2 → 3 → 4 → 6), four times
/// E4M3's step: a boundary lies in the way 4× less often, and a flip moves an element 4× further,
/// so (1 − cosine) and the largest error grow about 4×: output within 0.4, gradients at cosine
/// ≥ 0.93, losses within 2 % as before. Measured against the emulation on the language model
/// (np 1, 2, 4; stage 07 at D 2 × T 2 and D 2; L 2 and 4): cosine ≥ 0.950, max rel ≤ 0.27, losses
/// within 1e-3; against the plain double reference the same default run is at cosine
/// 0.888–0.970, with 7 of its 23 tensors below 0.93.
constexpr CheckTolerance kFp4Check{.rtol = 0.4, .cosine = 0.93, .loss_rtol = 0.02};

/// The estimate's term for rank 0's host copies of the first step (--check / --dump).
constexpr std::string_view kSnapshotTerm = "first-step snapshot (--check/--dump)";

/// The header's words for --recompute.
std::string recompute_text(const BlockConfig& c) {
  switch (c.recompute) {
    case Recompute::full:
      return fmt::format(
          "full on {} of {} layers (every {}; each such block's forward runs again before its "
          "backward, collectives too)",
          c.recomputed_layers(), c.layers, c.recompute_every);
    case Recompute::selective:
      return "selective (RMSNorm and SwiGLU's product run again before each block's backward; "
             "no collective repeated)";
    case Recompute::none:
      break;
  }
  return "none";
}

/// Stage 06's --fp8-recipe (stage 07's under --dtype fp8) when it is one of the finer recipes, as
/// the ranks agreed on it; nothing under tensorwise, without FP8 GEMMs, or on other stages.
std::optional<lowp::Recipe> finer_recipe(const StageOptions& o) {
  if (!is_fp8(o.config.dtype)) return std::nullopt;
  for (const auto& group : o.flag_groups)
    for (const auto& [flag, value] : group->agreed())
      if (flag == "--fp8-recipe")
        if (const auto recipe = lowp::parse_recipe(value);
            recipe && *recipe != lowp::Recipe::tensorwise)
          return recipe;
  return std::nullopt;
}

/// The header's words after the dtype: a finer recipe and how its GEMMs multiply (the
/// dequantized operands in fp32, or on Hopper rowwise and block128 through cuBLASLt's scale modes:
/// 06_fp8/recipes.cc, ops::gemm_scaled), so that no timing of the emulation reads as a
/// low-precision GEMM's.
std::string recipe_words(const StageOptions& o) {
  const auto recipe = finer_recipe(o);
  if (!recipe) return std::string();
  const bool native =
      o.config.device == Device::cuda && ops::scaled_gemm_problem(o.config.device, *recipe).empty();
  return fmt::format(" (--fp8-recipe {}: {})", lowp::to_string(*recipe),
                     lowp::native::gemm_words(*recipe, native));
}

/// The run's header; with `dry_run` it stops before the step table's column names.
void print_header(const StageDefinition& st, const StageOptions& o, const BlockConfig& c, int world,
                  const std::string& comm, const std::string& placement, const Speed& speed,
                  const MemoryEstimate& memory, std::uint64_t reference, std::uint64_t available,
                  bool dry_run = false) {
  fmt::print("tpx {} | {}\n", st.info.name, st.info.summary);
  fmt::print("ranks {} | device {} | dtype {}{} | attention {} | comm {}\n", world,
             to_string(c.device), dtype_flag(c.dtype), recipe_words(o), attention_flag(c.attention),
             comm);
  fmt::print("{}\n", placement);
  fmt::print("H {} NH {} NKV {} (D {}) F {} S {} B {} L {} | steps {} lr {:g} seed {}\n", c.hidden,
             c.heads, c.kv_heads_or_heads(), c.head_dim(), c.ffn, c.seq, c.batch, c.layers, c.steps,
             c.lr, c.seed);
  if (c.lm()) fmt::print("task lm | V {} | data {}\n", c.vocab, TokenStream(c).describe());
  if (const MoeConfig& m = c.moe; m.experts > 0)
    fmt::print(
        "experts E {} of FE {}{}, top {} by {} | {} | {} | {}\n", m.experts, m.expert_ffn,
        m.shared_ffn > 0 ? fmt::format(" and shared SF {}", m.shared_ffn) : std::string(), m.topk,
        m.router == MoeRouter::sigmoid ? "sigmoid" : "softmax",
        m.every == 1 ? std::string("every layer") : fmt::format("the layers l % {} = 0", m.every),
        m.capacity_factor > 0 ? fmt::format("capacity factor {:g}", m.capacity_factor)
                              : std::string("dropless"),
        m.bias_rate > 0 ? fmt::format("balance: bias, step {:g}", m.bias_rate)
                        : fmt::format("balance: aux loss, W {:g}", m.aux_loss_weight));
  fmt::print("optimizer {} | rope {} | recompute {}\n",
             c.optimizer == Optimizer::adamw
                 ? fmt::format("adamw (beta1 {:g}, beta2 {:g}, eps {:g}, weight decay {:g})",
                               c.beta1, c.beta2, c.eps, c.weight_decay)
                 : std::string("sgd"),
             c.rope() ? fmt::format("theta {:g}", c.rope_theta) : std::string("off"),
             recompute_text(c));
  if (!c.checkpoint.resume_dir.empty())
    fmt::print("resumed from {} (step {})\n", c.checkpoint.resume_dir, c.checkpoint.resume_step);
  if (!c.checkpoint.save_dir.empty())
    fmt::print("checkpoints to {}/step-<N> {}{}\n", c.checkpoint.save_dir,
               c.checkpoint.save_every > 0
                   ? fmt::format("every {} steps and at the end", c.checkpoint.save_every)
                   : std::string("at the end"),
               c.checkpoint.async_save
                   ? " (asynchronous: a thread writes each while the steps go on)"
                   : "");
  if (c.device == Device::cpu)
    fmt::print("(cpu backend: timings show the mechanics, not GPU speed)\n");
  if (speed.gpu())
    fmt::print(
        "gpu {} | bf16 GEMM peak {:.1f} TFLOP/s (measured by rank 0 alone before the steps: "
        "cuBLASLt bf16 in and out, 8192^3, mean of 10 after 3 warm-up) | {:.4g} TFLOP per step per "
        "rank (GEMMs, flops.h)\n",
        ops::device_name(c.device), speed.peak_tflops, speed.flops_per_rank / 1e12);
  fmt::print("memory estimate per rank: {}{} | {} available\n", memory.describe(),
             reference > 0 ? fmt::format(" | --check reference {}", bytes_text(reference)) : "",
             available == std::numeric_limits<std::uint64_t>::max() ? std::string("unknown")
                                                                    : bytes_text(available));
  if (std::ranges::any_of(memory.terms,
                          [](const MemoryTerm& t) { return t.name == kSnapshotTerm; }))
    fmt::print("(the snapshot is host memory beside the step's tensors: peak leaves it out)\n");
  if (dry_run) return;
  fmt::print("\n{:>5} {:>13} {:>12} {:>10} {:>10} {:>13} {:>11} {:>11}", "step", "loss",
             "grad norm", "step ms", "exposed ms", "payload/rank", "bus/rank", "peak");
  if (speed.gpu()) fmt::print(" {:>8} {:>6} {:>11}", "TFLOP/s", "MFU %", "reserved");
  if (c.recompute == Recompute::full) fmt::print(" {:>14}", "recompute bus");
  if (c.eval_every > 0) fmt::print(" {:>13}", "held-out loss");
  fmt::print("\n");
}

void print_row(const StepRow& r, const Speed& speed, const BlockConfig& c) {
  fmt::print("{:>5} {:>13.8f} {:>12.6e} {:>10.2f} {:>10.2f} {:>13} {:>11} {:>11}", r.step, r.loss,
             r.grad_norm, r.ms, r.exposed_comm_ms, bytes_text(r.comm.payload_bytes),
             bytes_text(r.comm.bus_bytes), bytes_text(r.peak_bytes));
  if (speed.gpu()) {
    const double tf = speed.tflops(r.ms);
    fmt::print(" {:>8.1f} {:>6.1f} {:>11}", tf, 100.0 * tf / speed.peak_tflops,
               bytes_text(r.reserved_bytes));
  }
  if (c.recompute == Recompute::full) fmt::print(" {:>14}", bytes_text(r.recompute_comm.bus_bytes));
  if (c.eval_every > 0)
    fmt::print(" {:>13}", std::isfinite(r.eval_loss) ? fmt::format("{:.8f}", r.eval_loss) : "");
  fmt::print("\n");
  if (!r.saved.empty()) fmt::print("      saved {} ({:.2f} ms)\n", r.saved, r.save_ms);
  std::fflush(stdout);
}

/// The run's configuration, as --json and --dump's config.json record it: every size resolved
/// (from --model, --config and the flags), and the preset and file they came from ("" if none).
/// Stage 10's experts (BlockConfig::moe), or null for a dense model.
json moe_json(const MoeConfig& m) {
  if (m.experts == 0) return nullptr;
  return {{"experts", m.experts},
          {"topk", m.topk},
          {"expert_ffn", m.expert_ffn},
          {"shared_ffn", m.shared_ffn},
          {"every", m.every},
          {"router", m.router == MoeRouter::sigmoid ? "sigmoid" : "softmax"},
          {"capacity_factor", m.capacity_factor},
          {"aux_loss_weight", m.aux_loss_weight},
          {"bias_rate", m.bias_rate},
          {"skew", m.skew}};
}

json config_json(const StageOptions& o) {
  const BlockConfig& c = o.config;
  return {{"model", o.model},
          {"config_file", o.config_file},
          {"hidden", c.hidden},
          {"heads", c.heads},
          {"ffn", c.ffn},
          {"seq", c.seq},
          {"batch", c.batch},
          {"layers", c.layers},
          {"steps", c.steps},
          {"lr", c.lr},
          {"seed", c.seed},
          {"eps", kNormEps},
          {"device", to_string(c.device)},
          {"dtype", dtype_flag(c.dtype)},
          {"attention", attention_flag(c.attention)},
          {"kv_heads", c.kv_heads_or_heads()},
          {"rope_theta", c.rope_theta},
          {"recompute", recompute_flag(c.recompute)},
          {"recompute_every", c.recompute_every},
          {"optimizer", optimizer_flag(c.optimizer)},
          {"beta1", c.beta1},
          {"beta2", c.beta2},
          {"optimizer_eps", c.eps},
          {"weight_decay", c.weight_decay},
          {"task", task_flag(c.task)},
          {"vocab", c.lm() ? json(c.vocab) : json(nullptr)},
          {"data", c.lm() ? json(c.data) : json(nullptr)},
          {"eval_every", c.eval_every},
          {"save", c.checkpoint.save_dir},
          {"save_every", c.checkpoint.save_every},
          {"async_save", c.checkpoint.async_save},
          {"resume", c.checkpoint.resume_dir},
          {"resume_step", c.checkpoint.resume_step},
          {"moe", moe_json(c.moe)}};
}

void write_dump(const fs::path& dir, const StageOptions& o, const std::string& stage, int world,
                const Snapshot& s) {
  const BlockConfig& c = o.config;
  const std::vector<std::int64_t> act{c.seq, c.batch, c.hidden};
  write_npy(dir / "input.npy", s.input, act);
  if (!s.target.empty()) write_npy(dir / "target.npy", s.target, act);
  if (c.lm()) {
    const std::vector<std::int64_t> ids{c.seq, c.batch};
    write_npy(dir / "tokens.npy", std::span<const std::int32_t>(s.tokens), ids);
    write_npy(dir / "targets.npy", std::span<const std::int32_t>(s.targets), ids);
    const std::array<std::vector<std::int64_t>, kLmParams> shapes = {
        {{c.vocab, c.hidden}, {c.hidden}, {c.hidden, c.vocab}}};
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      const std::string base(kLmParamNames[i]);
      write_npy(dir / (base + ".npy"), s.lm_params[i], shapes[i]);
      write_npy(dir / (base + ".grad.npy"), s.lm_grads[i], shapes[i]);
    }
  }
  write_npy(dir / "output.npy", s.output, act);
  write_npy(dir / "input.grad.npy", s.input_grad, act);
  const float loss = static_cast<float>(s.loss);
  write_npy(dir / "loss.npy", std::span(&loss, 1), {1});
  for (std::size_t l = 0; l < s.params.size(); ++l)
    for (Param p : kAllParams) {
      const auto i = static_cast<std::size_t>(p);
      if (s.params[l][i].empty()) continue;  // a MoE layer's MLP: its experts are below
      const auto base = fmt::format("layers.{}.{}", l, param_name(p));
      write_npy(dir / (base + ".npy"), s.params[l][i], param_shape(p, c));
      write_npy(dir / (base + ".grad.npy"), s.grads[l][i], param_shape(p, c));
    }
  for (const NamedArray<float>& t : s.extra_params)
    write_npy(dir / (t.name + ".npy"), t.values, t.shape);
  for (const NamedArray<float>& t : s.extra_grads)
    write_npy(dir / (t.name + ".grad.npy"), t.values, t.shape);
  for (const auto& [name, t] : s.extra) {
    fs::create_directories((dir / name).parent_path());
    const fs::path path = dir / (name + ".npy");
    if (t.dtype() == DType::f32)
      write_npy(path, t.f32(), t.shape());
    else  // FP8 codes, as bytes
      write_npy(path, std::span(t.data<std::uint8_t>(), t.nbytes()), t.shape());
  }
  json cfg = config_json(o);
  cfg["stage"] = stage;
  cfg["world_size"] = world;
  // The stage's own flags (stage 06's --fp8-recipe: "fp8_recipe", stage 07's --dp: "dp"), as the
  // ranks agreed on them: a whole number as a number, anything else as the text given.
  for (const auto& group : o.flag_groups)
    for (const auto& [flag, value] : group->agreed()) {
      std::string key = flag.substr(flag.find_first_not_of('-'));
      std::ranges::replace(key, '-', '_');
      if (cfg.contains(key)) continue;
      std::int64_t number = 0;
      const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), number);
      if (ec == std::errc() && end == value.data() + value.size() && !value.empty())
        cfg[key] = number;
      else
        cfg[key] = value;
    }
  write_text_file(dir / "config.json", cfg.dump(2) + '\n');
}

/// Prints "<stage>: error: <message>" on this rank's stderr and returns `code`.
int print_error(const StageDefinition& st, const std::string& message, int code) {
  fmt::print(stderr, "{}: error: {}\n", st.info.name, message);
  std::fflush(stderr);
  return code;
}

/// An error every rank agreed on (the same message and code everywhere): rank 0 says it once,
/// and every rank returns `code`. mpirun aborts the job when the first rank exits non-zero, so
/// the others first wait (a few seconds at most) until rank 0 has printed.
int print_agreed_error(const StageDefinition& st, const std::string& message, int code, int rank) {
  if (rank == 0) print_error(st, message, code);
  MPI_Request said = MPI_REQUEST_NULL;
  TPX_MPI_CHECK(MPI_Ibarrier(MPI_COMM_WORLD, &said));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (int done = 0; !done && std::chrono::steady_clock::now() < deadline;) {
    TPX_MPI_CHECK(MPI_Test(&said, &done, MPI_STATUS_IGNORE));
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return code;
}

/// Each rank's own start-up problems before anything is allocated: a single-device stage on
/// several ranks, a fault injected into a rank that does not exist, a device this rank cannot
/// use, an output path rank 0 cannot write (output.h's rule; rank 0 also removes its dead
/// writers' temporaries there). Empty when there are none.
std::string startup_problem(const StageDefinition& st, const StageOptions& o, int rank, int world) {
  const BlockConfig& c = o.config;
  if (st.info.single_device && world > 1)
    return fmt::format("{} is single-device; run it with one rank (got {})", st.info.name, world);
  if (o.comm.fault_rank >= world)
    return fmt::format("--fault-skip-collective names rank {}, but the job has ranks 0..{}",
                       o.comm.fault_rank, world - 1);
  if (o.comm.signal_fault_rank >= world)
    return fmt::format("--fault-skip-signal names rank {}, but the job has ranks 0..{}",
                       o.comm.signal_fault_rank, world - 1);
  if (o.comm.copy_fault_rank >= world)
    return fmt::format("--fault-delay-copy names rank {}, but the job has ranks 0..{}",
                       o.comm.copy_fault_rank, world - 1);
  if (c.checkpoint.kill_rank >= world)
    return fmt::format("--fault-kill-in-save names rank {}, but the job has ranks 0..{}",
                       c.checkpoint.kill_rank, world - 1);
  if (c.checkpoint.full_rank >= world)
    return fmt::format("--fault-full-disk-in-save names rank {}, but the job has ranks 0..{}",
                       c.checkpoint.full_rank, world - 1);
  if (o.comm.copy_delay_us < 0 || o.comm.copy_delay_us > 1'000'000)
    return fmt::format("--fault-copy-delay-us must be 0 … 1000000 (got {})", o.comm.copy_delay_us);
  if (o.comm.comm_delay_us < 0 || o.comm.comm_delay_us > 1'000'000)
    return fmt::format("--fault-comm-delay-us must be 0 … 1000000 (got {})", o.comm.comm_delay_us);
  if (std::string p = ops::device_problem(c.device); !p.empty()) return p;
  if (is_fp8(c.dtype))
    if (std::string p = ops::fp8_problem(c.device); !p.empty()) return p;
  if (rank != 0) return {};
  {
    // No two outputs in one file (or one inside the dump), none over an input.
    std::vector<NamedPath> outputs, inputs;
    if (!o.json_path.empty()) outputs.push_back({"--json", o.json_path});
    if (!o.trace_path.empty()) outputs.push_back({"--trace", o.trace_path});
    if (!o.dump_dir.empty()) outputs.push_back({"--dump", o.dump_dir, /*directory=*/true});
    if (!o.config_file.empty()) inputs.push_back({"--config", o.config_file});
    if (std::string p = output_collision(outputs, inputs); !p.empty()) return p;
  }
  if (!o.json_path.empty())
    if (std::string p = output_file_problem("--json", o.json_path); !p.empty()) return p;
  if (!o.trace_path.empty())
    if (std::string p = output_file_problem("--trace", o.trace_path); !p.empty()) return p;
  if (!o.dump_dir.empty())
    if (std::string p = prepare_dump_dir(o.dump_dir); !p.empty()) return p;
  return {};
}

/// This rank's memory estimate, and a problem when the ranks of this host together need more
/// than the device has available (host: MemAvailable, shared by the host's ranks; cuda: the
/// free memory of the GPU, shared by the ranks that use it).
struct MemoryCheck {
  MemoryEstimate estimate;      ///< training
  std::uint64_t reference = 0;  ///< --check's reference run on rank 0 (0: none)
  std::uint64_t available = 0;
  std::string problem;
};

MemoryCheck check_memory(const StageOptions& o, const Sharding& sharding, int rank) {
  const BlockConfig& c = o.config;
  MemoryCheck m;
  m.estimate = estimate_training_memory(c, sharding);
  // Rank 0 also keeps full copies of the first step's tensors for --check / --dump (host memory).
  const bool snapshot = rank == 0 && (o.check || !o.dump_dir.empty());
  if (snapshot && c.device == Device::cpu)
    m.estimate.terms.push_back({std::string(kSnapshotTerm), snapshot_bytes(c)});
  std::uint64_t mine = m.estimate.total();
  // --check then runs the reference on rank 0, after training has freed its model: the whole
  // unsharded model next to the snapshot; stage 01's reference is in double precision, about
  // twice the fp32 model's bytes (cpu figures: on cuda only the device's part is counted).
  if (rank == 0 && o.check) {
    const bool sharded = sharding.weights || sharding.sequence;
    const std::uint64_t model = estimate_training_memory(c, Sharding{}).total();
    const auto times = checked_mul<std::uint64_t>(sharded ? 1 : 2, model);
    const auto with_snapshot =
        times ? checked_add(*times, snapshot ? snapshot_bytes(c) : 0) : std::nullopt;
    if (!with_snapshot) throw SizeOverflow("the --check reference's bytes do not fit in 64 bits");
    if (sharded || c.device == Device::cpu) m.reference = *with_snapshot;
    mine = std::max(mine, m.reference);
  }
  // The ranks that draw from the same memory: those on this host (and, on cuda, this GPU).
  MPI_Comm local = MPI_COMM_NULL;
  TPX_MPI_CHECK(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local));
  MPI_Comm sharing = local;
  if (c.device == Device::cuda)
    TPX_MPI_CHECK(MPI_Comm_split(local, ops::device_ordinal(c.device), rank, &sharing));
  std::uint64_t together = 0;
  int ranks = 1;
  TPX_MPI_CHECK(MPI_Allreduce(&mine, &together, 1, MPI_UINT64_T, MPI_SUM, sharing));
  TPX_MPI_CHECK(MPI_Comm_size(sharing, &ranks));
  if (sharing != local) MPI_Comm_free(&sharing);
  MPI_Comm_free(&local);
  m.available = ops::memory_available(c.device);
  if (together > m.available) {
    const MemoryTerm big =
        m.reference > m.estimate.total()
            ? MemoryTerm{"the --check reference (whole model on rank 0)", m.reference}
            : m.estimate.biggest();
    const bool cpu = c.device == Device::cpu;
    const std::string need =
        ranks > 1 ? fmt::format("the {} ranks sharing this {} need {} ({} on this rank", ranks,
                                cpu ? "host" : "GPU", bytes_text(together), bytes_text(mine))
                  : fmt::format("this run needs {} (", bytes_text(mine));
    m.problem =
        fmt::format("not enough memory: {}{}biggest term: {} {}), {} of {} available", need,
                    ranks > 1 ? "; " : "", big.name, bytes_text(big.bytes), bytes_text(m.available),
                    cpu ? "host memory (MemAvailable)" : "GPU memory");
  }
  return m;
}

/// What --json records before any step runs (a dry run's too): the config, the mesh, the
/// memory estimate and its terms, and a step's FLOPs per rank.
json plan_json(const StageDefinition& st, const StageOptions& o, int world, const std::string& comm,
               const Sharding& sharding, const Speed& speed, const MemoryEstimate& estimate) {
  const BlockConfig& c = o.config;
  json summary = {{"stage", st.info.name},
                  {"world_size", world},
                  {"comm", comm},
                  {"config", config_json(o)},
                  {"memory_estimate_bytes", estimate.total()}};
  summary["device_description"] = ops::device_description(c.device);  // tpx_report's, bench.py's
  summary["dp"] = sharding.dp;  // the mesh's data-parallel degree (1 but in stages 07 and 08)
  summary["cp"] = sharding.cp;  // and its context-parallel degree (1 but in stages 08 and 09)
  summary["pp"] = sharding.pp;  // and its pipeline-parallel degree (1 but in stage 09)
  json terms = json::object();  // the estimate's terms, by name (stage 07: sharded and unsharded)
  for (const MemoryTerm& t : estimate.terms) terms[t.name] = t.bytes;
  summary["memory_terms"] = terms;
  summary["optimizer_state_bytes"] =
      c.optimizer == Optimizer::adamw ? estimate.term("optimizer state").bytes : std::uint64_t{0};
  summary["flops_per_step_per_rank"] = speed.flops_per_rank;
  // What the device executes: the model's FLOPs plus --recompute full's second forward.
  summary["executed_flops_per_step_per_rank"] = step_flops(c).executed() / double(world);
  summary["recompute_flops_per_step_per_rank"] = step_flops(c).recompute / double(world);
  summary["recomputed_layers"] = c.recomputed_layers();
  return summary;
}

/// The named counters every stage's --json carries, 0 where a stage adds none, so that one
/// schema reads every stage (tools/bench.py, tools/mesh_svg.py): the mesh groups that stages
/// 07 (dp), 08 (cp) and 09 (pp) add, and the timer stage 08 adds for the CP group's attention.
/// A counter a stage adds under another name is written as well.
constexpr std::array<std::string_view, 3> kReportedGroups = {"dp", "cp", "pp"};
constexpr std::array<std::string_view, 1> kReportedTimes = {"cp_attention"};

/// The names of kReportedGroups or kReportedTimes (`fixed`), then those of `added` not among
/// them.
template <std::size_t N, class T>
std::vector<std::string> reported_names(const std::array<std::string_view, N>& fixed,
                                        const std::vector<T>& added) {
  std::vector<std::string> names(fixed.begin(), fixed.end());
  for (const T& x : added)
    if (std::find(names.begin(), names.end(), x.name) == names.end()) names.push_back(x.name);
  return names;
}

/// A --json step row: the step's numbers, its traffic, and every named counter of the stage
/// (`<group>_bus_bytes`, `<group>_payload_bytes`; `<timer>_ms`, `<timer>_ms_per_block`).
json step_json(const StepRow& row) {
  json j = {{"step", row.step},
            {"loss", row.loss},
            {"grad_norm", row.grad_norm},
            {"ms", row.ms},
            {"exposed_comm_ms", row.exposed_comm_ms},
            {"comm_payload_bytes", row.comm.payload_bytes},
            {"comm_bus_bytes", row.comm.bus_bytes},
            {"comm_calls", row.comm.calls},
            {"recompute_bus_bytes", row.recompute_comm.bus_bytes},
            {"recompute_payload_bytes", row.recompute_comm.payload_bytes},
            {"peak_bytes", row.peak_bytes},
            {"reserved_bytes", row.reserved_bytes}};
  if (std::isfinite(row.eval_loss)) j["eval_loss"] = row.eval_loss;
  if (!row.saved.empty()) {
    j["saved"] = row.saved;
    j["save_ms"] = row.save_ms;
    j["save_async"] = row.save_async;
  }
  for (const std::string& name : reported_names(kReportedGroups, row.comm.groups)) {
    const GroupTraffic g = row.comm.group(name);
    j[name + "_bus_bytes"] = g.bus_bytes;
    j[name + "_payload_bytes"] = g.payload_bytes;
  }
  for (const std::string& name : reported_names(kReportedTimes, row.comm.times)) {
    const StepTime t = row.comm.time(name);
    j[name + "_ms"] = t.ms;
    j[name + "_ms_per_block"] = t.blocks > 0 ? t.ms / double(t.blocks) : 0.0;
  }
  return j;
}

/// The --json summary: the config, every completed step, and what ended the run.
json summary_json(const StageDefinition& st, const StageOptions& o, int world,
                  const Parallelism& par, const TrainResult& r, const Speed& speed,
                  const MemoryEstimate& estimate) {
  const BlockConfig& c = o.config;
  json rows = json::array();
  for (const auto& row : r.rows) rows.push_back(step_json(row));
  json summary = plan_json(st, o, world, par.comm_name(), par.sharding(), speed, estimate);
  summary["steps"] = rows;
  summary["saved_activation_bytes"] = r.saved_activation_bytes;
  if (r.extra.is_object()) summary.update(r.extra);
  if (!r.diverged.empty()) summary["diverged"] = r.diverged;
  if (speed.gpu()) {
    summary["device_name"] = ops::device_name(c.device);
    summary["bf16_gemm_peak_tflops"] = speed.peak_tflops;
    for (auto& row : summary["steps"]) {
      const double tf = speed.tflops(row["ms"].get<double>());
      row["tflops"] = tf;
      row["mfu"] = tf / speed.peak_tflops;
    }
  }
  return summary;
}

/// Every rank's host memory over training, on rank 0 (empty elsewhere).
struct HostMemoryReport {
  std::vector<std::uint64_t> peak, baseline, estimate;
};

HostMemoryReport gather_host_memory(std::uint64_t peak, std::uint64_t baseline,
                                    std::uint64_t estimate, int rank, int world) {
  const std::uint64_t mine[3] = {peak, baseline, estimate};
  std::vector<std::uint64_t> all(rank == 0 ? 3 * std::size_t(world) : 0);
  TPX_MPI_CHECK(MPI_Gather(mine, 3, MPI_UINT64_T, all.data(), 3, MPI_UINT64_T, 0, MPI_COMM_WORLD));
  HostMemoryReport h;
  for (std::size_t i = 0; i < all.size(); i += 3) {
    h.peak.push_back(all[i]);
    h.baseline.push_back(all[i + 1]);
    h.estimate.push_back(all[i + 2]);
  }
  return h;
}

/// --dry-run's lines of a step's bytes per group: the TP group's (what the named groups leave),
/// then each named group the stage's plan lists that communicates, in its order.
void print_plan_groups(const StagePlan& plan) {
  auto line = [](std::string_view label, const Traffic& t) {
    fmt::print("  {:<22} {} bus, {} payload, {} calls\n", label, bytes_text(t.bus),
               bytes_text(t.payload), t.calls);
  };
  const Traffic& all = plan.traffic;
  Traffic named;
  for (const PlanGroup& g : plan.groups) named += g.traffic;
  if (all.calls == 0) fmt::print("  {:<22} none\n", "communication");
  if (all.calls > named.calls)
    line(named.calls > 0 ? "tp group" : "tp group (all ranks)",
         {all.payload - named.payload, all.bus - named.bus, all.calls - named.calls});
  for (const PlanGroup& g : plan.groups)
    if (g.traffic.calls > 0) line(g.label, g.traffic);
}

/// --dry-run's line of a checkpoint's size: each rank's shard file (runs of ranks whose files
/// print alike together; --json has the bytes) and all of them, the small index.json left out.
std::string checkpoint_size_text(const std::vector<std::int64_t>& bytes) {
  std::string ranks;
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < bytes.size();) {
    const std::string size = bytes_text(std::uint64_t(bytes[i]));
    std::size_t j = i;
    while (j + 1 < bytes.size() && bytes_text(std::uint64_t(bytes[j + 1])) == size) ++j;
    ranks += fmt::format("{}{} {}{}", ranks.empty() ? "" : ", ",
                         j == i ? fmt::format("rank {}", i) : fmt::format("ranks {}-{}", i, j),
                         size, j == i ? "" : " each");
    for (std::size_t r = i; r <= j; ++r) total += std::uint64_t(bytes[r]);
    i = j + 1;
  }
  return fmt::format("{}; about {} in all", ranks, bytes_text(total));
}

/// --dry-run: the stage's plan (its split checks, sharding and a step's bytes), the memory
/// estimate (reported, not refused) and a step's FLOPs, printed by rank 0 and written to --json;
/// nothing is computed and no tensor allocated, so any size answers at once.
int dry_run(const StageDefinition& st, const StageOptions& o, int rank, int world,
            const NodeMap& nodes) {
  const BlockConfig& c = o.config;
  Trace trace(Trace::Mode::measure);
  const StagePlan plan = st.plan(RunContext{o, rank, world, trace});
  const MemoryCheck memory = check_memory(o, plan.sharding, rank);
  const Speed speed{step_flops(c).total() / double(world), 0.0};
  const Traffic& all = plan.traffic;
  const std::uint64_t saved = memory.estimate.term("saved activations").bytes;
  // A save's rank-<r>.bin files (--save DIR): each rank's from the parts its cut saves.
  const std::int64_t shard_bytes = checkpoint_file_bytes(c, plan.sharding);
  std::vector<std::int64_t> checkpoint(rank == 0 ? std::size_t(world) : 0);
  TPX_MPI_CHECK(MPI_Gather(&shard_bytes, 1, MPI_INT64_T, checkpoint.data(), 1, MPI_INT64_T, 0,
                           MPI_COMM_WORLD));
  if (rank == 0) {
    print_header(st, o, c, world, plan.comm, nodes.layout(), speed, memory.estimate,
                 memory.reference, memory.available, /*dry_run=*/true);
    const StepFlops f = step_flops(c);
    fmt::print(
        "\ndry run: nothing computed or allocated; one training step per rank, from the formulas "
        "(common/flops.h, the stage's traffic.h, common/memory.h)\n");
    fmt::print("  {:<22} {:.4g} TFLOP (the GEMMs of forward + backward{})\n", "FLOPs",
               speed.flops_per_rank / 1e12,
               f.recompute > 0 ? fmt::format("; {:.4g} TFLOP executed with the recompute",
                                             f.executed() / double(world) / 1e12)
                               : "");
    print_plan_groups(plan);
    fmt::print("  {:<22} {}\n", "saved activations", bytes_text(saved));
    fmt::print("  {:<22} {} ({})\n", "peak memory estimate", bytes_text(memory.estimate.total()),
               memory.problem.empty() ? "fits" : "would be refused: " + memory.problem);
    fmt::print("  {:<22} {}\n", "checkpoint (--save)",
               c.moe.experts > 0 ? "not taken: a checkpoint does not hold the experts yet"
                                 : checkpoint_size_text(checkpoint));
  }
  if (!o.json_path.empty() && rank == 0) {
    json summary = plan_json(st, o, world, plan.comm, plan.sharding, speed, memory.estimate);
    summary["dry_run"] = true;
    summary["saved_activation_bytes"] = saved;
    summary["step"] = {{"comm_payload_bytes", all.payload},
                       {"comm_bus_bytes", all.bus},
                       {"comm_calls", all.calls}};
    for (const std::string& name : reported_names(kReportedGroups, plan.groups)) {
      const Traffic t = plan.group(name);
      summary["step"][name + "_payload_bytes"] = t.payload;
      summary["step"][name + "_bus_bytes"] = t.bus;
    }
    // Each rank's shard file; their sum (the index.json beside them not in it).
    summary["checkpoint_bytes_per_rank"] = checkpoint;
    std::int64_t total = 0;
    for (const std::int64_t b : checkpoint) total += b;
    summary["checkpoint_bytes"] = total;
    summary["memory_available_bytes"] = memory.available;
    if (!memory.problem.empty()) summary["memory_problem"] = memory.problem;
    write_text_file(o.json_path, summary.dump(2) + '\n');  // checked writable at start-up
  }
  return 0;
}

/// The recipe --check's reference emulates: stage 06's --fp8-recipe under --dtype fp8, when it is
/// not tensorwise (tensorwise is checked against the stage's plain reference); nothing otherwise.
/// The emulation's group is the rank's tensor-parallel group and its replicas the mesh's
/// data-parallel ones (`sh`: stage 06's whole job; stage 07's D × T mesh).
std::optional<LowpEmulation> emulated_recipe(const StageOptions& o, const Sharding& sh) {
  const auto recipe = finer_recipe(o);
  if (!recipe) return std::nullopt;
  LowpEmulation e{.recipe = *recipe,
                  .ranks = sh.world,
                  .replicas = sh.dp,
                  .bf16_tokens = o.config.activations() == DType::bf16};
  e.keep_last = o.config.fp8_keep_last;  // stage 06's --fp8-keep-last: no recipe in the last blocks
  return e;
}

/// --check's tolerance: the stage's, at least bf16's under the bf16 recipe; FP8's cosine rule.
CheckTolerance check_tolerance(const StageDefinition& st, DType dtype,
                               const std::optional<LowpEmulation>& emulated) {
  if (emulated && emulated->recipe == lowp::Recipe::nvfp4) return kFp4Check;
  if (is_fp8(dtype)) return kFp8Check;
  return {.rtol = dtype == DType::bf16 ? std::max(st.rtol, kBf16CheckRtol) : st.rtol};
}

/// The mean step after the warm-up (rank 0). Step 0 warms up (first allocations, GEMM
/// heuristics, lazily made transports): the mean is over the steps after it, when there are any.
void print_mean_step(const TrainResult& r) {
  if (r.rows.empty()) return;
  const std::size_t first = r.rows.size() > 1 ? 1 : 0;
  double total = 0, exposed = 0;
  for (std::size_t i = first; i < r.rows.size(); ++i) {
    total += r.rows[i].ms;
    exposed += r.rows[i].exposed_comm_ms;
  }
  const auto steps = double(r.rows.size() - first);
  fmt::print("\nmean step {:.2f} ms (exposed comm {:.2f} ms; {}) | saved activations {} per rank\n",
             total / steps, exposed / steps,
             first == 1 ? fmt::format("steps {}-{}, step {} warms up", r.rows[1].step,
                                      r.rows.back().step, r.rows[0].step)
                        : fmt::format("step {}", r.rows[0].step),
             bytes_text(r.saved_activation_bytes));
}

/// --generate on rank 0: the prompt's continuation by the trained model, printed after the step
/// table and returned (the new text alone); nothing without --generate or after a divergence.
std::string print_generated(const BlockConfig& c, const TrainResult& r) {
  const GenerateOptions& g = c.generate;
  if (g.tokens == 0 || !r.diverged.empty()) return {};
  const Tokenizer tok = Tokenizer::load(tokenizer_path_for(c.data));
  const std::vector<std::int32_t> ids = generate(c, r.trained, tok.encode(g.prompt));
  const std::string text = valid_utf8(tok.decode(ids));
  fmt::print("\ngenerated {} tokens ({}), one forward of the trained model per token:\n{}{}\n",
             g.tokens,
             g.temperature == 0
                 ? std::string("greedy")
                 : fmt::format("temperature {:g}{}, seed {}", g.temperature,
                               g.top_k > 0 ? fmt::format(", top-k {}", g.top_k) : "", c.seed),
             valid_utf8(g.prompt), text);
  return text;
}

/// --check on rank 0: the first step's tensors and the first losses against the stage's
/// single-device reference, one row per tensor, then PASS or FAIL. Returns the verdict and the
/// rows for --json.
std::pair<bool, json> print_check(const StageDefinition& st, const BlockConfig& c,
                                  const TrainResult& r, const CheckTolerance& tol,
                                  const std::optional<LowpEmulation>& emulated) {
  const int steps = static_cast<int>(std::min<std::int64_t>(c.steps, kCheckSteps));
  BlockConfig plain = c;  // the reference neither saves nor resumes
  plain.checkpoint = {};
  const ReferenceRun want =
      emulated ? reference_run_lowp(plain, steps, *emulated) : st.reference(plain, steps);
  fmt::print(
      "\ncheck against the reference{} (relative error = max|got - want| / max|want|, "
      "tolerance {:.0e}{})\n",
      emulated ? fmt::format(" emulating --fp8-recipe {} in double", to_string(emulated->recipe))
               : "",
      tol.rtol,
      tol.cosine > 0 ? fmt::format("; gradients: cosine similarity >= {}; losses: {:.0e}",
                                   tol.cosine, tol.loss_rtol)
                     : "");
  fmt::print("{:<34} {:>12} {:>12}{}\n", "tensor", "max abs", "max rel",
             tol.cosine > 0 ? fmt::format(" {:>10}", "cosine") : "");
  bool pass = true;
  json rows;
  for (const auto& row : compare(r.first, r.rows, want, tol)) {
    const std::string verdict =
        row.ok
            ? "ok"
            : (row.nonfinite > 0 ? fmt::format("FAIL ({} NaN/Inf values)", row.nonfinite) : "FAIL");
    fmt::print("{:<34} {:>12.3e} {:>12.3e}{}  {}\n", row.name, row.max_abs, row.max_rel,
               tol.cosine > 0 ? fmt::format(" {:>10.6f}", row.cosine) : "", verdict);
    pass = pass && row.ok;
    rows.push_back({{"tensor", row.name},
                    {"max_abs", row.max_abs},
                    {"max_rel", row.max_rel},
                    {"nonfinite", row.nonfinite},
                    {"cosine", row.cosine},
                    {"ok", row.ok}});
  }
  fmt::print("{}\n", pass ? "PASS" : "FAIL");
  return {pass, rows};
}

/// Runs after MPI is up and every rank's command line parsed. Returns the exit code.
int run(const StageDefinition& st, const StageOptions& o, int rank, int world) {
  const BlockConfig& c = o.config;
  // Start-up, in the order that keeps every rank together: the same flags everywhere, then each
  // rank's own checks (agreed), then the memory the model will take (agreed), then the model.
  if (std::string d = config_disagreement(config_fields(st.info, o)); !d.empty())
    throw ConfigError(d);
  stop_if_any_rank(startup_problem(st, o, rank, world), world);
  const NodeMap nodes = NodeMap::discover();  // which node every rank runs on
  if (o.dry_run && !st.plan)  // every stage's plan is its formulas; a stage without them says so
    throw ConfigError(fmt::format("{} has no --dry-run: it has no traffic formula (traffic.h) yet",
                                  st.info.name));
  if (o.dry_run) return dry_run(st, o, rank, world, nodes);
  if (st.answer_instead) {
    Trace off;
    if (const auto text = st.answer_instead(RunContext{o, rank, world, off})) {
      if (rank == 0) fmt::print("{}", *text);
      return 0;
    }
  }

  // One flight recorder and watchdog per rank, shared by every communicator and symmetric memory
  // the stage makes, so that a stall gets one verdict (common/comm/watchdog.h).
  StageOptions with_monitor = o;
  if (!st.info.single_device) with_monitor.comm.monitor = make_comm_monitor(o.comm);
  Trace trace(o.trace_path.empty() ? Trace::Mode::measure : Trace::Mode::keep);
  auto par = st.make(RunContext{with_monitor, rank, world, trace});
  const Placement placement = place(nodes, par->mesh_groups());
  const MemoryCheck memory = check_memory(o, par->sharding(), rank);
  stop_if_any_rank(memory.problem, world);

  Speed speed{step_flops(c).total() / double(world), 0.0};
  if (rank == 0) {
    speed.peak_tflops = ops::bf16_gemm_peak_tflops(c.device);  // 0 on the cpu
    print_header(st, o, c, world, par->comm_name(), placement.header, speed, memory.estimate,
                 memory.reference, memory.available);
  }
  // Ranks that share rank 0's GPU must not start their steps while it measures the peak.
  if (c.device == Device::cuda) TPX_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
  // The host memory training takes, as the kernel counts it: the high-water mark from here on,
  // beside what the process holds before the model is made (MPI, BLAS, the binary, the
  // communicators); the estimate counts the difference.
  const bool peak_reset = reset_host_peak();
  const std::uint64_t host_baseline = host_memory().rss;
  const TrainResult r =
      st.train(c, *par, o.check || !o.dump_dir.empty(), trace, [&](const StepRow& row) {
        if (rank != 0) return;
        // A TP group across nodes: once, with the TP bytes step 0 moved (the DP bytes apart).
        if (row.step == 0)
          if (const std::string w =
                  placement.tp_warning(row.comm.bus_bytes - row.comm.group("dp").bus_bytes);
              !w.empty())
            fmt::print(stderr, "{}: warning: {}\n", st.info.name, w);
        print_row(row, speed, c);
      });
  const HostMemoryReport host =
      gather_host_memory(host_memory().peak, host_baseline, memory.estimate.total(), rank, world);
  // A run with a fault flag is meant to end in the watchdog's verdict. One that got here says
  // what became of the fault (never fired, an op without peers, a skip nobody noticed) and
  // writes nothing: a skipped op's results were not all computed.
  const std::string faults =
      with_monitor.comm.monitor ? with_monitor.comm.monitor->fault_report() : std::string();
  if (const StartVerdict v = agree_to_start(!faults.empty(), kExitFail, faults); v.stop) {
    with_monitor.comm.monitor->barrier();
    return print_agreed_error(st, v.message, kExitFail, rank);
  }
  if (rank == 0) print_mean_step(r);
  const std::string generated = rank == 0 ? print_generated(c, r) : std::string();

  // Outputs are written by rank 0 (the trace's gather is collective); a failure to write one is
  // agreed like a start-up problem, so that every rank exits with rank 0's message.
  bool pass = true;
  json check_json;
  const std::optional<LowpEmulation> emulated = emulated_recipe(o, par->sharding());
  const CheckTolerance tol = check_tolerance(st, c.dtype, emulated);
  std::string write_problem;
  auto on_rank0 = [&](auto&& write) {
    if (rank != 0 || !write_problem.empty()) return;
    try {
      write();
    } catch (const Error& e) {
      write_problem = e.what();
    }
  };
  if (!o.dump_dir.empty() && !r.rows.empty())
    on_rank0([&] {
      // Staged, then moved in (output.h): a new directory appears whole; an existing one is kept
      // and receives one run's whole set.
      write_dump_dir(o.dump_dir, [&](const fs::path& staging) {
        write_dump(staging, o, st.info.name, world, r.first);
      });
      fmt::print("dumped first-step tensors to {}\n", o.dump_dir);
    });
  if (o.check && r.diverged.empty()) {
    if (rank == 0)
      std::tie(pass, check_json) = print_check(st, par->reference_config(c), r, tol, emulated);
    pass = !agree_to_start(rank == 0 && !pass, kExitFail, "").stop;
  }
  if (!o.json_path.empty())
    on_rank0([&] {
      json summary = summary_json(st, o, world, *par, r, speed, memory.estimate);
      summary["host_peak_bytes"] = host.peak[0];
      summary["host_baseline_bytes"] = host.baseline[0];
      summary["host_peak_bytes_per_rank"] = host.peak;
      summary["host_baseline_bytes_per_rank"] = host.baseline;
      summary["memory_estimate_bytes_per_rank"] = host.estimate;
      summary["host_peak_since_baseline"] = peak_reset;
      if (c.generate.tokens > 0 && r.diverged.empty())
        summary["generated"] = {{"prompt", valid_utf8(c.generate.prompt)}, {"text", generated}};
      if (o.check && r.diverged.empty())
        summary["check"] = {{"pass", pass},
                            {"rtol", tol.rtol},
                            {"min_cosine", tol.cosine},
                            {"loss_rtol", tol.loss_rtol > 0 ? tol.loss_rtol : tol.rtol},
                            {"tensors", check_json}};
      write_text_file(o.json_path, summary.dump(2) + '\n');
    });
  if (trace.enabled()) {
    try {
      trace.write(o.trace_path, rank, world, st.info.name);  // collective; rank 0 writes; may throw
    } catch (const Error& e) {
      if (write_problem.empty()) write_problem = e.what();
    }
  }
  // No rank leaves while another may still ask for its records.
  if (with_monitor.comm.monitor) with_monitor.comm.monitor->barrier();
  if (const StartVerdict v = agree_to_start(!write_problem.empty(), kExitFail, write_problem);
      v.stop)
    return print_agreed_error(st, v.message, kExitFail, rank);  // only rank 0 writes
  // The loss and gradient norm are global, so every rank sees the same divergence.
  if (!r.diverged.empty()) return print_agreed_error(st, r.diverged, kExitDiverged, rank);
  return pass ? 0 : kExitFail;
}

}  // namespace

int run_stage(const StageDefinition& st, int argc, char** argv) {
  MpiSession mpi(argc, argv);
  const CliOutcome cli = parse_stage_cli(st.info, argc, argv);
  // The job's first collective: if any rank's command line did not parse (or asked for --help),
  // every rank stops here with that rank's message instead of waiting for it in a collective.
  const StartVerdict v = agree_to_start(!cli.options, cli.exit_code, cli.message);
  if (v.stop) {
    if (v.exit_code == 0) {
      if (mpi.rank() == 0) fmt::print("{}", v.message);
      return 0;
    }
    return print_agreed_error(st, verdict_text(v, mpi.world()), v.exit_code, mpi.rank());
  }
  // A ConfigError is agreed (stop_if_any_rank, config_disagreement, the checks every rank makes
  // on the same facts), and SizeOverflow identical on every rank (sizes are agreed): said once.
  try {
    return run(st, *cli.options, mpi.rank(), mpi.world());
  } catch (const ConfigError& e) {
    return print_agreed_error(st, e.what(), kExitConfig, mpi.rank());
  } catch (const SizeOverflow& e) {
    return print_agreed_error(st, e.what(), kExitConfig, mpi.rank());
  } catch (const SaveError& e) {  // agreed too: every rank throws the same one
    return print_agreed_error(st, e.what(), kExitFail, mpi.rank());
  } catch (const std::exception& e) {
    print_error(st, e.what(), kExitFail);
    if (mpi.world() > 1) MPI_Abort(MPI_COMM_WORLD, kExitFail);
    return kExitFail;
  }
}

}  // namespace tpx
