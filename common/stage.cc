#include "stage.h"

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "check.h"
#include "flops.h"
#include "npy.h"
#include "ops.h"
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

/// True on every rank iff `ok` is true on every rank.
bool all_ranks(bool ok) {
  int mine = ok ? 1 : 0, all = 0;
  TPX_MPI_CHECK(MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  return all == 1;
}

/// Empty if DIR can be created and written; otherwise why not.
std::string dump_dir_problem(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return fmt::format("cannot create --dump directory '{}': {}", dir, ec.message());
  const fs::path probe = fs::path(dir) / ".tpx-write-test";
  if (!std::ofstream(probe)) return fmt::format("cannot write into --dump directory '{}'", dir);
  fs::remove(probe, ec);
  return {};
}

double mib(std::size_t bytes) {
  return double(bytes) / (1024.0 * 1024.0);
}

/// What the speed columns need: this rank's GEMM FLOPs per step and the device's bf16 peak.
struct Speed {
  double flops_per_rank = 0;
  double peak_tflops = 0;  ///< measured; 0 on the cpu (no TFLOP/s / MFU columns there)
  bool gpu() const { return peak_tflops > 0; }
  double tflops(double ms) const { return ms > 0 ? flops_per_rank / (ms * 1e-3) / 1e12 : 0.0; }
};

/// --check tolerance: bf16 GEMM operands carry 8 significant bits (unit roundoff 2^-9 ≈ 2e-3);
/// the errors of a few chained GEMMs, relative to each tensor's largest value, stay well below
/// 3e-2, while a wrong result is off by O(1).
constexpr double kBf16CheckRtol = 3e-2;

void print_header(const StageDefinition& st, const BlockConfig& c, int world,
                  const Parallelism& par, const Speed& speed) {
  fmt::print("tpx {} | {}\n", st.info.name, st.info.summary);
  fmt::print("ranks {} | device {} | dtype {} | comm {}\n", world, to_string(c.device),
             to_string(c.dtype), par.comm_name());
  fmt::print("H {} NH {} (D {}) F {} S {} B {} L {} | T {} lr {} seed {}\n", c.hidden, c.heads,
             c.head_dim(), c.ffn, c.seq, c.batch, c.layers, c.steps, c.lr, c.seed);
  if (c.device == Device::cpu)
    fmt::print("(cpu backend: timings show the mechanics, not GPU speed)\n");
  if (speed.gpu())
    fmt::print(
        "gpu {} | bf16 GEMM peak {:.1f} TFLOP/s (measured) | {:.4g} TFLOP per step per "
        "rank (GEMMs, flops.h)\n",
        ops::device_name(c.device), speed.peak_tflops, speed.flops_per_rank / 1e12);
  fmt::print("\n{:>5} {:>13} {:>12} {:>10} {:>14} {:>14} {:>10}", "step", "loss", "grad norm",
             "step ms", "comm B/rank", "bus B/rank", "peak MB");
  if (speed.gpu()) fmt::print(" {:>8} {:>6}", "TFLOP/s", "MFU %");
  fmt::print("\n");
}

void print_row(const StepRow& r, const Speed& speed) {
  fmt::print("{:>5} {:>13.8f} {:>12.6e} {:>10.2f} {:>14} {:>14} {:>10.2f}", r.step, r.loss,
             r.grad_norm, r.ms, r.comm.payload_bytes, r.comm.bus_bytes, mib(r.peak_bytes));
  if (speed.gpu()) {
    const double tf = speed.tflops(r.ms);
    fmt::print(" {:>8.1f} {:>6.1f}", tf, 100.0 * tf / speed.peak_tflops);
  }
  fmt::print("\n");
  std::fflush(stdout);
}

/// The run's configuration, as --json and --dump's config.json record it.
json config_json(const BlockConfig& c) {
  return {{"hidden", c.hidden},
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
          {"dtype", to_string(c.dtype)}};
}

void write_dump(const fs::path& dir, const BlockConfig& c, const std::string& stage, int world,
                const Snapshot& s) {
  const std::vector<std::int64_t> act{c.seq, c.batch, c.hidden};
  write_npy(dir / "input.npy", s.input, act);
  write_npy(dir / "target.npy", s.target, act);
  write_npy(dir / "output.npy", s.output, act);
  write_npy(dir / "input.grad.npy", s.input_grad, act);
  const float loss = static_cast<float>(s.loss);
  write_npy(dir / "loss.npy", std::span(&loss, 1), {1});
  for (std::size_t l = 0; l < s.params.size(); ++l)
    for (Param p : kAllParams) {
      const auto i = static_cast<std::size_t>(p);
      const auto base = fmt::format("layers.{}.{}", l, param_name(p));
      write_npy(dir / (base + ".npy"), s.params[l][i], param_shape(p, c));
      write_npy(dir / (base + ".grad.npy"), s.grads[l][i], param_shape(p, c));
    }
  json cfg = config_json(c);
  cfg["stage"] = stage;
  cfg["world_size"] = world;
  std::ofstream(dir / "config.json") << cfg.dump(2) << '\n';
}

/// Runs after MPI is up and the command line is valid. Returns the exit code.
int run(const StageDefinition& st, const StageOptions& o, int rank, int world) {
  const BlockConfig& c = o.config;
  if (st.info.single_device && world > 1)
    throw ConfigError(
        fmt::format("{} is single-device; run it with one rank (got {})", st.info.name, world));
  // Every rank must be able to use the device, or none starts (a rank that stopped alone would
  // leave the others waiting in their first collective).
  const std::string device_problem = ops::device_problem(c.device);
  if (!all_ranks(device_problem.empty()))
    throw ConfigError(device_problem.empty()
                          ? fmt::format("another rank cannot use --device {}", to_string(c.device))
                          : device_problem);
  const std::string dump_problem =
      (rank == 0 && !o.dump_dir.empty()) ? dump_dir_problem(o.dump_dir) : "";
  if (!all_ranks(dump_problem.empty()))
    throw ConfigError(rank == 0 ? dump_problem : "rank 0 cannot write the --dump directory");

  Trace trace(!o.trace_path.empty());
  auto par = st.make(RunContext{o, rank, world, trace});
  Speed speed{step_flops(c).total() / double(world), 0.0};
  if (rank == 0) {
    speed.peak_tflops = ops::bf16_gemm_peak_tflops(c.device);  // 0 on the cpu
    print_header(st, c, world, *par, speed);
  }
  const TrainResult r =
      train(c, *par, o.check || !o.dump_dir.empty(), trace, [&](const StepRow& row) {
        if (rank == 0) print_row(row, speed);
      });
  if (rank == 0) {
    double total = 0;
    for (const auto& row : r.rows) total += row.ms;
    fmt::print("\nmean step {:.2f} ms | saved activations {:.2f} MiB per rank ({} bytes)\n",
               total / double(r.rows.size()), mib(r.saved_activation_bytes),
               r.saved_activation_bytes);
  }

  bool pass = true;
  json check_json;
  const double rtol = c.dtype == DType::bf16 ? std::max(st.rtol, kBf16CheckRtol) : st.rtol;
  if (rank == 0 && !o.dump_dir.empty()) {
    write_dump(o.dump_dir, c, st.info.name, world, r.first);
    fmt::print("dumped first-step tensors to {}\n", o.dump_dir);
  }
  if (o.check) {
    if (rank == 0) {
      const int steps = static_cast<int>(std::min<std::int64_t>(c.steps, kCheckSteps));
      const ReferenceRun want = st.reference(c, steps);
      const auto rows = compare(r.first, r.rows, want, rtol);
      fmt::print(
          "\ncheck against the reference (relative error = max|got - want| / max|want|, "
          "tolerance {:.0e})\n",
          rtol);
      fmt::print("{:<34} {:>12} {:>12}\n", "tensor", "max abs", "max rel");
      for (const auto& row : rows) {
        fmt::print("{:<34} {:>12.3e} {:>12.3e}  {}\n", row.name, row.max_abs, row.max_rel,
                   row.ok ? "ok" : "FAIL");
        pass = pass && row.ok;
        check_json.push_back({{"tensor", row.name},
                              {"max_abs", row.max_abs},
                              {"max_rel", row.max_rel},
                              {"ok", row.ok}});
      }
      fmt::print("{}\n", pass ? "PASS" : "FAIL");
    }
    pass = all_ranks(rank != 0 || pass);
  }

  if (rank == 0 && !o.json_path.empty()) {
    json rows = json::array();
    for (const auto& row : r.rows)
      rows.push_back({{"step", row.step},
                      {"loss", row.loss},
                      {"grad_norm", row.grad_norm},
                      {"ms", row.ms},
                      {"comm_payload_bytes", row.comm.payload_bytes},
                      {"comm_bus_bytes", row.comm.bus_bytes},
                      {"comm_calls", row.comm.calls},
                      {"peak_bytes", row.peak_bytes}});
    json summary = {{"stage", st.info.name},
                    {"world_size", world},
                    {"comm", par->comm_name()},
                    {"config", config_json(c)},
                    {"steps", rows},
                    {"saved_activation_bytes", r.saved_activation_bytes}};
    summary["flops_per_step_per_rank"] = speed.flops_per_rank;
    if (speed.gpu()) {
      summary["device_name"] = ops::device_name(c.device);
      summary["bf16_gemm_peak_tflops"] = speed.peak_tflops;
      for (auto& row : summary["steps"]) {
        const double tf = speed.tflops(row["ms"].get<double>());
        row["tflops"] = tf;
        row["mfu"] = tf / speed.peak_tflops;
      }
    }
    if (o.check) summary["check"] = {{"pass", pass}, {"rtol", rtol}, {"tensors", check_json}};
    std::ofstream out(o.json_path);
    if (!(out << summary.dump(2) << '\n')) fail(fmt::format("cannot write '{}'", o.json_path));
  }
  if (trace.enabled()) trace.write(o.trace_path, rank, world);
  return pass ? 0 : 1;
}

}  // namespace

int run_stage(const StageDefinition& st, int argc, char** argv) {
  MpiSession mpi(argc, argv);
  const CliOutcome cli = parse_stage_cli(st.info, argc, argv);
  if (!cli.options) {
    if (cli.exit_code == 0) {
      if (mpi.rank() == 0) fmt::print("{}", cli.message);
    } else {
      fmt::print(stderr, "{}: error: {}\n", st.info.name, cli.message);
    }
    return cli.exit_code;
  }
  try {
    return run(st, *cli.options, mpi.rank(), mpi.world());
  } catch (const ConfigError& e) {
    fmt::print(stderr, "{}: error: {}\n", st.info.name, e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: error: {}\n", st.info.name, e.what());
    std::fflush(stderr);
    if (mpi.world() > 1) MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}

}  // namespace tpx
