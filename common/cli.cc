#include "cli.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <string_view>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "check.h"
#include "checkpoint.h"
#include "cli_flags.h"
#include "cli_hint.h"
#include "data.h"
#include "generate.h"
#include "output.h"
#include "presets.h"

namespace tpx {
namespace {

/// A --config file that is not a config: too large, or not text (the line and column of its first
/// byte that is not); parse_stage_cli's message adds the file's name.
class ConfigNotText : public CLI::ConfigError {
 public:
  using CLI::ConfigError::ConfigError;
};

/// --config's reader: CLI11's TOML/INI parser, behind a check that the file is lines of text
/// (a binary file is refused at its first byte that is not, instead of being echoed back as
/// keys), remembering the line of each key for the messages about it.
class ConfigReader : public CLI::ConfigTOML {
 public:
  static constexpr std::size_t kMaxConfigBytes = 1 << 20;

  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override {
    lines_.clear();
    // A config is a few lines: a file past the limit (/dev/zero, a disk image) is not one, and
    // is not read whole into memory to find that out.
    std::string text(kMaxConfigBytes + 1, '\0');
    input.read(text.data(), std::streamsize(text.size()));
    text.resize(std::size_t(input.gcount()));
    if (text.size() > kMaxConfigBytes)
      throw ConfigNotText(
          fmt::format("is larger than {} bytes, more than a config file holds", kMaxConfigBytes));
    std::string section;
    int number = 0;
    for (std::size_t at = 0; at < text.size();) {
      const std::size_t end = std::min(text.find('\n', at), text.size());
      std::string_view line(text.data() + at, end - at);
      at = end + 1;
      ++number;
      if (line.ends_with('\r')) line.remove_suffix(1);  // a CRLF file
      std::string spaced(line);  // a tab is white space here, not a byte to refuse
      std::ranges::replace(spaced, '\t', ' ');
      if (const std::size_t bad = unprintable_at(spaced); bad != std::string::npos)
        throw ConfigNotText(fmt::format(
            "line {}, column {}: byte {:#04x} is not text (a config file holds `name = value` "
            "lines)",
            number, bad + 1, static_cast<unsigned char>(line[bad])));
      remember(line, section, number);
    }
    std::istringstream again(text);
    return CLI::ConfigTOML::from_config(again);
  }

  /// The line (from 1) of the first item named `key` ("hidden", or "section.name"); 0 if none.
  int line_of(std::string_view key) const {
    const auto it = lines_.find(std::string(key));
    return it == lines_.end() ? 0 : it->second;
  }

 private:
  /// Notes the key of `line`: the text before '=' (or the whole line, a flag), trimmed and
  /// unquoted, under the `[section]` it lies in.
  void remember(std::string_view line, std::string& section, int number) const {
    auto trim = [](std::string_view s) {
      const auto first = s.find_first_not_of(" \t");
      if (first == std::string_view::npos) return std::string_view();
      return s.substr(first, s.find_last_not_of(" \t") - first + 1);
    };
    line = trim(line);
    if (line.empty() || line.front() == '#' || line.front() == ';') return;
    if (line.front() == '[' && line.back() == ']') {
      const std::string_view name = trim(line.substr(1, line.size() - 2));
      section = name == "default" ? "" : std::string(name) + ".";
      return;
    }
    std::string_view key = trim(line.substr(0, line.find('=')));
    if (key.size() >= 2 && (key.front() == '"' || key.front() == '\'') && key.back() == key.front())
      key = key.substr(1, key.size() - 2);
    lines_.emplace(section + std::string(key), number);
  }

  mutable std::map<std::string, int> lines_;
};

/// Registers a hidden RANK:<what> flag (fault injection) that sets `rank` and `value`, both >= 0.
void add_rank_pair(CLI::App& app, const std::string& flag, const std::string& what, int& rank,
                   std::int64_t& value, const std::string& help) {
  app.add_option_function<std::string>(
         flag,
         [&rank, &value, flag, what](const std::string& s) {
           const auto colon = s.find(':');
           if (colon == std::string::npos)
             throw CLI::ValidationError(
                 fmt::format("{} '{}': expected RANK:{}, e.g. 1:7", flag, s, what));
           rank = parse_number<int>(flag + " RANK", s.substr(0, colon));
           value = parse_number<std::int64_t>(flag + " " + what, s.substr(colon + 1));
           if (rank < 0 || value < 0)
             throw CLI::ValidationError(
                 fmt::format("{} '{}': RANK and {} must be >= 0", flag, s, what));
         },
         help)
      ->type_name("RANK:" + what)
      ->group("");
}

}  // namespace

namespace {

/// What the choice flags are given as, before they become enums.
struct Choices {
  std::string device, dtype, attention, optimizer, recompute, comm_kind, task;
};

/// The app: name, summary, the footer's words on ranks and exit codes, --help's layout.
void describe_app(CLI::App& app, const StageInfo& info) {
  app.footer(fmt::format(
      "{}\n\nEvery rank must be given the same flags. Exit status: 0 done (and --check "
      "passed); 1 --check failed, an output could not be written, or communication stalled; 2 "
      "bad input, or a config that cannot run here (too large for memory, ranks that disagree); "
      "3 training diverged (a loss or gradient norm became NaN or infinite).",
      info.single_device
          ? "Single-device stage: run it directly or under `mpirun -np 1`; with more ranks it "
            "exits with an error."
          : "Run under `mpirun -np N`; N must divide the sizes the stage splits."));
  app.get_formatter()->column_width(26);
}

/// Model sizes: H, NH, NKV, F, S, B, L, or a model by name, or a file of flags.
void add_size_flags(CLI::App& app, StageOptions& o) {
  BlockConfig& c = o.config;
  auto sizes = "Model sizes";
  add_number(app, "--hidden", c.hidden, "H, the model width")->group(sizes);
  add_number(app, "--heads", c.heads, "NH, attention heads (H % NH == 0)")->group(sizes);
  add_number(app, "--kv-heads", c.kv_heads,
             "NKV, key/value heads of grouped-query attention (NH % NKV == 0; query head h reads "
             "KV head h/(NH/NKV)); NH when not given")
      ->default_str("NH")
      ->group(sizes);
  add_number(app, "--ffn", c.ffn, "F, the SwiGLU inner size")->group(sizes);
  add_number(app, "--seq", c.seq, "S, sequence length")->group(sizes);
  add_number(app, "--batch", c.batch, "B, batch size")->group(sizes);
  add_number(app, "--layers", c.layers, "L, stacked blocks")->group(sizes);
  app.add_option("--model", o.model,
                 fmt::format("a model by name, setting the sizes above and --rope-theta (flags "
                             "and --config win): {}",
                             preset_names()))
      ->type_name("NAME")
      ->group(sizes);
  app.set_config("--config", "",
                 "read flags from a TOML/INI file (`hidden = 4096`, `kv-heads = 8`, `model = "
                 "\"llama3-8b\"`); the command line wins over the file, the file over --model")
      ->type_name("FILE")
      ->group(sizes);
  app.allow_config_extras(CLI::config_extras_mode::error);
}

/// What the run trains: the language model on a token stream, or the blocks alone.
void add_task_flags(CLI::App& app, BlockConfig& c, std::string& task) {
  auto model = "Language model";
  app.add_option("--task", task,
                 "lm (token ids → embedding → the blocks → final RMSNorm → output layer → "
                 "cross-entropy against the next token) or block (the blocks alone: random "
                 "input, mean-squared loss against a random target)")
      ->check(CLI::IsMember({"lm", "block"}))
      ->capture_default_str()
      ->group(model);
  add_number(app, "--vocab", c.vocab,
             fmt::format("V, the vocabulary ({} … {}); the token file's when not given, {} for "
                         "--data synthetic",
                         kMinVocab, kMaxVocab, kSyntheticVocab))
      ->default_str("from --data")
      ->group(model);
  app.add_option("--data", c.data,
                 "the token stream: a token file made by tpx_tokenize (its train split; each "
                 "step's B sequences start at offsets drawn from --seed), or synthetic (ids "
                 "drawn from --seed)")
      ->type_name("FILE")
      ->capture_default_str()
      ->group(model);
  add_number(app, "--eval-every", c.eval_every,
             "the loss on the held-out split every K steps and at the last, forward only (0: "
             "never)")
      ->type_name("K")
      ->group(model);
}

/// Text from the trained model (common/generate.h).
void add_generate_flags(CLI::App& app, GenerateOptions& g) {
  auto group = "Generation";
  add_number(app, "--generate", g.tokens,
             "after training, rank 0 continues --prompt by N tokens with the trained model and "
             "prints them (decoded by the tokenizer beside the token file: <name>.tokenizer.json "
             "for <name>.tokens)")
      ->type_name("N")
      ->group(group);
  app.add_option("--prompt", g.prompt, "the text --generate continues")
      ->type_name("TEXT")
      ->capture_default_str()
      ->group(group);
  add_number(app, "--temperature", g.temperature,
             "0: the most likely token each time; T > 0: a draw from softmax(logits / T), from "
             "--seed")
      ->type_name("T")
      ->group(group);
  add_number(app, "--top-k", g.top_k, "with T > 0: draw among the K most likely tokens (0: all)")
      ->type_name("K")
      ->group(group);
}

/// The optimizer: SGD, or AdamW with its four settings.
void add_optimizer_flags(CLI::App& app, BlockConfig& c, std::string& optimizer) {
  auto opt = "Optimizer";
  app.add_option("--optimizer", optimizer,
                 "sgd (w -= lr·grad) or adamw (torch.optim.AdamW: bias-corrected moments, "
                 "decoupled weight decay on the seven matrices, none on the norm gains)")
      ->check(CLI::IsMember({"sgd", "adamw"}))
      ->capture_default_str()
      ->group(opt);
  add_number(app, "--beta1", c.beta1, "AdamW's first-moment decay")->group(opt);
  add_number(app, "--beta2", c.beta2, "AdamW's second-moment decay")->group(opt);
  add_number(app, "--eps", c.eps, "AdamW's epsilon, added to the root of the second moment")
      ->group(opt);
  add_number(app, "--weight-decay", c.weight_decay,
             "AdamW's decoupled weight decay (the seven matrices only)")
      ->group(opt);
}

/// The run: steps and learning rate (then the optimizer's group), seed, device, precision,
/// attention, RoPE, recomputation.
void add_run_flags(CLI::App& app, const StageInfo& info, BlockConfig& c, Choices& choices) {
  auto run = "Run";
  add_number(app, "--steps", c.steps,
             "training steps (each: forward, loss, backward, optimizer update)")
      ->group(run);
  add_number(app, "--lr", c.lr,
             fmt::format("learning rate (SGD runs the blocks at 1 and the language model at {:g}; "
                         "AdamW wants ~1e-3)",
                         kLmDefaultLr))
      ->default_str(fmt::format("1 (--task block), {:g} (--task lm)", kLmDefaultLr))
      ->group(run);
  add_optimizer_flags(app, c, choices.optimizer);
  add_number(app, "--seed", c.seed, "initialisation seed")->group(run);
  app.add_option("--device", choices.device, "backend: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str()
      ->group(run);
  const std::string common_dtypes =
      "fp32, or bf16 (bf16 activations and communication, fp32 master weights, gradients and op "
      "math)";
  std::vector<std::string> dtypes = {"fp32", "bf16"};
  if (info.own_dtype) dtypes.insert(dtypes.begin(), info.own_dtype->word);
  app.add_option("--dtype", choices.dtype,
                 info.own_dtype ? fmt::format("precision: {} ({}), {}", info.own_dtype->word,
                                              info.own_dtype->help, common_dtypes)
                                : "precision: " + common_dtypes)
      ->check(CLI::IsMember(dtypes))
      ->capture_default_str()
      ->group(run);
  app.add_option("--attention", choices.attention,
                 "fused (FlashAttention-2: blockwise, online softmax, keeps only the log-sum-exp) "
                 "or naive (materialises and keeps the S×S probabilities)")
      ->check(CLI::IsMember({"fused", "naive"}))
      ->capture_default_str()
      ->group(run);
  add_number(app, "--rope-theta", c.rope_theta,
             "θ of the rotary position embedding on q and k (Llama 3: 500000); 0 turns it off")
      ->type_name("THETA")
      ->group(run);
  app.add_option("--recompute", choices.recompute,
                 "none (keep every activation backward reads), full (keep only each block's "
                 "input and run the block's forward again, collectives included, before its "
                 "backward) or selective (keep the GEMMs' and attention's outputs, run RMSNorm "
                 "and SwiGLU's product again; no collective repeated)")
      ->check(CLI::IsMember({"none", "full", "selective"}))
      ->capture_default_str()
      ->group(run);
  add_number(app, "--recompute-every", c.recompute_every,
             "with --recompute full: recompute only layers l with l % K == 0")
      ->type_name("K")
      ->group(run);
}

/// Output: --dry-run, --check, --dump, --json, --trace.
void add_output_flags(CLI::App& app, StageOptions& o) {
  auto out = "Output";
  app.add_flag("--dry-run", o.dry_run,
               "compute and allocate nothing: print a step's FLOPs, bytes per group, saved "
               "activations and peak-memory estimate per rank from the formulas, at any size "
               "(with --json: the same as a file)")
      ->group(out);
  app.add_flag("--check", o.check,
               "compare output, input grad, every weight grad and the loss after 3 updates "
               "with the reference; exit non-zero on FAIL")
      ->group(out);
  app.add_option("--dump", o.dump_dir,
                 "write full float32 .npy tensors after the first "
                 "forward+backward into DIR")
      ->type_name("DIR")
      ->group(out);
  app.add_option("--json", o.json_path, "write a machine-readable run summary")
      ->type_name("FILE")
      ->group(out);
  app.add_option("--trace", o.trace_path,
                 "write a Chrome/Perfetto trace, one lane per rank and "
                 "stream")
      ->type_name("FILE")
      ->group(out);
}

/// Checkpoints: --save, --save-every, --resume (common/checkpoint.h).
void add_checkpoint_flags(CLI::App& app, CheckpointOptions& k) {
  auto group = "Checkpoints";
  app.add_option("--save", k.save_dir,
                 "save the training state (fp32 weights, AdamW moments, the step; the data and "
                 "noise follow from --seed and the step) to DIR/step-<N>/ at the end of the run: "
                 "one shard file per rank and an index.json, valid once the index is written")
      ->type_name("DIR")
      ->group(group);
  add_count(app, "--save-every", k.save_every, "with --save: also after every K-th step",
            "a save at the end of the run only")
      ->type_name("K")
      ->group(group);
  app.add_option("--resume", k.resume_dir,
                 "start from the checkpoint DIR/step-<N>/ with the largest N (or the step-<N> "
                 "directory DIR itself), saved on any number of ranks, and train on to --steps "
                 "(counted from the start of training)")
      ->type_name("DIR")
      ->group(group);
  app.add_flag("--async-save", k.async_save,
               "with --save: copy the state to host memory and write it on a thread of its own "
               "while the next steps run")
      ->group(group);
  add_rank_pair(app, "--fault-kill-in-save", "STEP", k.kill_rank, k.kill_step,
                "RANK:STEP: that rank kills itself (SIGKILL) in the save after step STEP, once "
                "its shard file is written and before the index");
  add_rank_pair(app, "--fault-full-disk-in-save", "STEP", k.full_rank, k.full_step,
                "RANK:STEP: in the save after step STEP, that rank's shard file cannot grow past "
                "half its size (its writes fail as on a full disk)");
}

/// Communication: --comm, --comm-timeout, and the watchdog tests' hidden fault injection.
void add_comm_flags(CLI::App& app, const StageInfo& info, CommOptions& comm,
                    std::string& comm_kind) {
  // A single-device stage does not communicate: its communication flags are hidden from --help
  // and rejected with a sentence that says why (instead of being silently ignored).
  const auto group = info.single_device ? "" : "Communication";
  app.add_option("--comm", comm_kind,
                 "collectives: nccl (cuda, one GPU per rank), mpi (host memory; cuda tensors are "
                 "staged through the host) or auto (nccl when every rank has its own GPU)")
      ->check(CLI::IsMember({"auto", "mpi", "nccl"}))
      ->capture_default_str()
      ->group(group);
  add_number(app, "--comm-timeout", comm.timeout_s,
             "seconds a communication op may take before the job aborts with one line naming "
             "the op and the rank that stopped it, followed in the same write by the last ops of "
             "every rank that answered; the ranks get a quarter of SECONDS (0.5 to 5 s) to "
             "answer, so a stall, a stopped rank included, is named at most SECONDS plus that "
             "after it began (at least 0.1)")
      ->type_name("SECONDS")
      ->group(group);
  // Fault injection for the watchdog's tests; hidden from --help (empty group). A RANK:N fault
  // is meant to end the run in the watchdog's verdict: a run that gets to its end says in one
  // line what became of it and exits 1 (CommOptions::fault_rank).
  add_rank_pair(app, "--fault-skip-collective", "SEQ", comm.fault_rank, comm.fault_seq,
                "RANK:SEQ: that rank silently skips its collective (or ring step) SEQ (0-based), "
                "unless no other rank takes part in it (then it runs, and the end of the run "
                "says so)");
  add_rank_pair(app, "--fault-skip-signal", "N", comm.signal_fault_rank, comm.signal_fault,
                "RANK:N: that rank never sends its symmetric-memory signal N (0-based), unless "
                "it is a signal to itself");
  add_rank_pair(app, "--fault-delay-copy", "N", comm.copy_fault_rank, comm.copy_fault,
                "RANK:N: that rank's copy-engine pull N (0-based) takes three comm timeouts");
  add_number(app, "--fault-copy-delay-us", comm.copy_delay_us,
             "each copy-lane pull and signal first waits a random 0..US microseconds")
      ->type_name("US")
      ->group("");
  add_number(app, "--fault-comm-delay-us", comm.comm_delay_us,
             "each communicator op first waits 0..US microseconds on its lane, a hash of rank "
             "and op number: the same wait on every run")
      ->type_name("US")
      ->group("");
}

/// The flag groups the stage names (StageInfo::flag_groups), made and added in its order; each
/// mesh dimension's help gives its default by the newest dimension among them. Returns them.
std::vector<std::shared_ptr<FlagGroup>> add_stage_flags(CLI::App& app, const StageInfo& info,
                                                        StageOptions& o) {
  std::vector<std::shared_ptr<FlagGroup>> groups;
  MeshFlag newest = MeshFlag::dp;
  for (const auto& make : info.flag_groups) {
    groups.push_back(make());
    if (const auto d = groups.back()->dimension()) newest = *d;
  }
  for (const auto& group : groups) {
    group->add_flags(app, newest);
    o.flag_groups.push_back(group);
  }
  return groups;  // the parse's own, which a preset may still set (FlagGroup::take_experts)
}

/// The choice flags' words as enums (CLI11 has checked that each is one of its words).
void apply_choices(const Choices& choices, StageOptions& o) {
  BlockConfig& c = o.config;
  o.comm.kind = parse_comm_kind(choices.comm_kind);
  c.device = parse_device(choices.device);
  c.dtype = parse_dtype(choices.dtype);
  c.attention = choices.attention == "naive" ? Attention::naive : Attention::fused;
  c.task = choices.task == "lm" ? Task::lm : Task::block;
  c.optimizer = choices.optimizer == "adamw" ? Optimizer::adamw : Optimizer::sgd;
  c.recompute = choices.recompute == "full"        ? Recompute::full
                : choices.recompute == "selective" ? Recompute::selective
                                                   : Recompute::none;
}

/// The flags that parse on their own but not together: one sentence for the first such pair,
/// nothing when they fit.
std::optional<std::string> check_combinations(const CLI::App& app, const StageInfo& info,
                                              const StageOptions& o, const Choices& choices) {
  auto given = [&](const char* flag) { return app.count(flag) > 0; };
  if (info.single_device)
    for (const char* flag :
         {"--comm", "--comm-timeout", "--fault-skip-collective", "--fault-skip-signal",
          "--fault-delay-copy", "--fault-copy-delay-us", "--fault-comm-delay-us"})
      if (given(flag))
        return fmt::format(
            "{} has no meaning for {}: it runs on one device and does not "
            "communicate",
            flag, info.name);
  if (!(o.comm.timeout_s >= kMinCommTimeout))
    return fmt::format(
        "--comm-timeout must be at least {} s (got {}): a shorter one would "
        "report a healthy job's ordinary waits as a stall",
        kMinCommTimeout, o.comm.timeout_s);
  if (o.config.optimizer == Optimizer::sgd)
    for (const char* flag : {"--beta1", "--beta2", "--eps", "--weight-decay"})
      if (given(flag))
        return fmt::format("{} is a setting of --optimizer adamw (this run uses sgd)", flag);
  if (given("--recompute-every") && o.config.recompute != Recompute::full)
    return fmt::format(
        "--recompute-every chooses the layers of --recompute full (got "
        "--recompute {})",
        choices.recompute);
  if (o.check && given("--resume"))
    return "--check compares a run from initialisation with the reference; it cannot start "
           "from --resume (leave out one of the two)";
  if (given("--save") && o.config.checkpoint.save_dir.empty()) return "--save: the path is empty";
  if (given("--async-save") && !given("--save"))
    return "--async-save needs --save DIR (where the checkpoints go)";
  if (given("--resume") && o.config.checkpoint.resume_dir.empty())
    return "--resume: the path is empty";
  if (o.dry_run)
    for (const char* flag : {"--check", "--dump", "--trace"})
      if (given(flag))
        return fmt::format(
            "{} needs a real run; --dry-run computes nothing (leave out one of "
            "the two)",
            flag);
  return std::nullopt;
}

/// The sizes --model sets where no flag (or --config) did, the --config file's name, and NKV
/// when --kv-heads is not given; an error for an unknown model or --kv-heads 0.
std::optional<std::string> resolve_model(const CLI::App& app, StageOptions& o,
                                         const std::vector<std::shared_ptr<FlagGroup>>& groups) {
  BlockConfig& c = o.config;
  auto given = [&](const char* flag) { return app.count(flag) > 0; };
  if (!o.model.empty()) {
    const ModelPreset* preset = find_preset(o.model);
    if (preset == nullptr)
      return fmt::format("--model {}: no such model (known: {})", o.model, preset_names());
    apply_preset(*preset,
                 {.hidden = given("--hidden"),
                  .heads = given("--heads"),
                  .kv_heads = given("--kv-heads"),
                  .ffn = given("--ffn"),
                  .layers = given("--layers"),
                  .seq = given("--seq"),
                  .batch = given("--batch"),
                  .rope_theta = given("--rope-theta")},
                 c);
    if (preset->moe.experts > 0) {
      bool taken = false;
      for (const auto& group : groups) taken = group->take_experts(preset->moe, app) || taken;
      if (!taken)
        return fmt::format(
            "--model {} is a mixture of experts: 10_expert_parallel trains it, this stage has no "
            "experts",
            o.model);
    }
  }
  if (app.get_config_ptr() != nullptr && given("--config"))
    o.config_file = app.get_config_ptr()->as<std::string>();
  if (!given("--kv-heads")) {
    if (o.model.empty()) c.kv_heads = c.heads;  // multi-head attention (a preset sets its NKV)
  } else if (c.kv_heads == 0) {
    return "--kv-heads must be positive (got 0; leave it out for NKV = NH)";
  }
  return std::nullopt;
}

/// The message for `e`, an error CLI11 raised while it read the --config file (the reader's
/// refusal, a key that is no flag, a value a flag refuses, a file it cannot open): the same
/// sentence, naming the file and the line. Nothing when no --config was given or `e` is about the
/// command line.
std::optional<std::string> config_error_text(const CLI::App& app, const ConfigReader& reader,
                                             const std::vector<std::string>& args,
                                             const CLI::ParseError& e) {
  const CLI::Option* config = app.get_config_ptr();
  if (config == nullptr || config->count() == 0) return std::nullopt;
  const std::string file = config->as<std::string>();
  const std::string named = fmt::format("--config '{}'", file);
  auto at_line = [&](int line) {
    return line > 0 ? fmt::format("{} line {}", named, line) : named;
  };
  const std::string what = e.what();
  if (dynamic_cast<const ConfigNotText*>(&e) != nullptr) return named + " " + what;
  if (dynamic_cast<const CLI::FileError*>(&e) != nullptr)
    return named + ": cannot be read as a file (missing, a directory, or not readable)";
  constexpr std::string_view extra = "INI was not able to parse ";
  if (dynamic_cast<const CLI::ConfigError*>(&e) != nullptr && what.starts_with(extra)) {
    const std::string key = what.substr(extra.size());
    const std::string near = closest_flag("--" + key, visible_flags(app));
    return fmt::format("{}: '{}' is not a flag of {}{}", at_line(reader.line_of(key)), key,
                       app.get_name(),
                       near.empty() ? "" : fmt::format(" (did you mean {}?)", near.substr(2)));
  }
  // A value a flag refused ("--hidden 'x': not an integer"): from the file when the flag is not
  // on the command line (which wins over the file) and the file sets it.
  if (!what.starts_with("--")) return std::nullopt;
  const std::string flag = what.substr(0, what.find_first_of(" :'="));
  const bool on_command_line = std::ranges::any_of(
      args, [&](const std::string& a) { return a == flag || a.starts_with(flag + "="); });
  const int line = reader.line_of(flag.substr(2));
  if (on_command_line || line == 0) return std::nullopt;
  return fmt::format("{}: {}", at_line(line), what);
}

/// A path or name flag given an empty value, which would otherwise read as "not given": --json,
/// --trace and --dump get output.h's own verdict on the path, --config and --model theirs.
std::optional<std::string> empty_value(const CLI::App& app, const StageOptions& o) {
  auto given = [&](const char* flag) { return app.count(flag) > 0; };
  if (given("--json") && o.json_path.empty()) return output_file_problem("--json", o.json_path);
  if (given("--trace") && o.trace_path.empty()) return output_file_problem("--trace", o.trace_path);
  if (given("--dump") && o.dump_dir.empty()) return prepare_dump_dir(o.dump_dir);
  if (given("--model") && o.model.empty())
    return fmt::format("--model: the name is empty (known: {})", preset_names());
  return std::nullopt;
}

}  // namespace

CliOutcome parse_stage_cli(const StageInfo& info, int argc, char** argv) {
  StageOptions o;
  Choices choices{
      .device = "cpu",
      .dtype = info.own_dtype && info.own_dtype->is_default ? info.own_dtype->word : "fp32",
      .attention = std::string(attention_flag(o.config.attention)),
      .optimizer = std::string(optimizer_flag(o.config.optimizer)),
      .recompute = std::string(recompute_flag(o.config.recompute)),
      .comm_kind = "auto",
      .task = "lm"};
  o.config.data = default_data();

  CLI::App app(fmt::format("{}: {}", info.name, info.summary), info.name);
  // A switch takes no value: "--check=5" is refused, not read as "--check".
  app.option_defaults()->disable_flag_override();
  describe_app(app, info);
  add_size_flags(app, o);
  add_run_flags(app, info, o.config, choices);
  add_task_flags(app, o.config, choices.task);
  add_generate_flags(app, o.config.generate);
  add_output_flags(app, o);
  add_checkpoint_flags(app, o.config.checkpoint);
  add_comm_flags(app, info, o.comm, choices.comm_kind);
  const std::vector<std::shared_ptr<FlagGroup>> groups = add_stage_flags(app, info, o);

  const auto reader = std::make_shared<ConfigReader>();
  app.config_formatter(reader);
  // Every refusal quotes what the user typed (or the file holds) in printable characters only.
  auto refuse = [](const std::string& message) {
    return CliOutcome{std::nullopt, printable(message), 2};
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    return {std::nullopt, app.help(), 0};
  } catch (const CLI::ParseError& e) {
    const std::vector<std::string> args(argv + std::min(argc, 1), argv + argc);
    if (auto text = config_error_text(app, *reader, args, e)) return refuse(*text);
    return refuse(parse_error_text(app, e));
  }
  // --config '': CLI11 reads no file for an empty name (and says nothing).
  if (app.count("--config") > 0 && app.get_config_ptr()->as<std::string>().empty())
    return refuse("--config: the path is empty");
  if (auto error = empty_value(app, o)) return refuse(*error);
  apply_choices(choices, o);
  if (auto error = check_combinations(app, info, o, choices)) return refuse(*error);
  if (auto error = resolve_model(app, o, groups)) return refuse(*error);
  for (const auto& group : o.flag_groups)
    if (auto error = group->check(app, o)) return refuse(*error);
  for (const auto& group : o.flag_groups) group->configure(o.config);
  if (o.config.lm()) {
    if (app.count("--lr") == 0) o.config.lr = kLmDefaultLr;
    if (auto error = resolve_token_source(o.config, app.count("--vocab") > 0))
      return refuse(*error);
  }
  if (auto error = check_generation(o.config)) return refuse(*error);
  if (const auto errors = validate(o.config); !errors.empty())
    return refuse(fmt::format("{}", fmt::join(errors, "; ")));
  if (auto error = checkpoint_flag_problem(o.config)) return refuse(*error);
  return {std::move(o), "", 0};
}

ConfigFields config_fields(const StageInfo& info, const StageOptions& o) {
  const BlockConfig& c = o.config;
  // Output paths are agreed by value: rank 0 writes them, so a path given to another rank alone
  // (or a different one) would be dropped silently.
  auto given = [](const std::string& path) {
    return path.empty() ? std::string("not given") : fmt::format("'{}'", path);
  };
  ConfigFields fields = {
      {"the stage", info.name},
      {"--hidden", fmt::format("{}", c.hidden)},
      {"--heads", fmt::format("{}", c.heads)},
      {"--ffn", fmt::format("{}", c.ffn)},
      {"--seq", fmt::format("{}", c.seq)},
      {"--batch", fmt::format("{}", c.batch)},
      {"--layers", fmt::format("{}", c.layers)},
      {"--steps", fmt::format("{}", c.steps)},
      {"--lr", fmt::format("{}", c.lr)},
      {"--optimizer", std::string(optimizer_flag(c.optimizer))},
      {"--beta1", fmt::format("{}", c.beta1)},
      {"--beta2", fmt::format("{}", c.beta2)},
      {"--eps", fmt::format("{}", c.eps)},
      {"--weight-decay", fmt::format("{}", c.weight_decay)},
      {"--seed", fmt::format("{}", c.seed)},
      {"--device", std::string(to_string(c.device))},
      {"--dtype", std::string(dtype_flag(c.dtype))},
      {"--attention", std::string(attention_flag(c.attention))},
      {"--kv-heads", fmt::format("{}", c.kv_heads_or_heads())},
      {"--rope-theta", fmt::format("{}", c.rope_theta)},
      {"--recompute", std::string(recompute_flag(c.recompute))},
      {"--recompute-every", fmt::format("{}", c.recompute_every)},
      {"--task", std::string(task_flag(c.task))},
      {"--vocab", fmt::format("{}", c.vocab)},
      {"--data", c.data},
      {"--eval-every", fmt::format("{}", c.eval_every)},
      {"--generate", fmt::format("{}", c.generate.tokens)},
      {"--comm", to_string(o.comm.kind)},
      {"--comm-timeout", fmt::format("{}", o.comm.timeout_s)},
      {"--fault-skip-collective", fmt::format("{}:{}", o.comm.fault_rank, o.comm.fault_seq)},
      {"--fault-skip-signal", fmt::format("{}:{}", o.comm.signal_fault_rank, o.comm.signal_fault)},
      {"--fault-delay-copy", fmt::format("{}:{}", o.comm.copy_fault_rank, o.comm.copy_fault)},
      {"--fault-copy-delay-us", fmt::format("{}", o.comm.copy_delay_us)},
      {"--fault-comm-delay-us", fmt::format("{}", o.comm.comm_delay_us)},
      {"--dry-run", o.dry_run ? "given" : "not given"},
      {"--save", given(c.checkpoint.save_dir)},
      {"--save-every", fmt::format("{}", c.checkpoint.save_every)},
      {"--async-save", c.checkpoint.async_save ? "given" : "not given"},
      {"--resume", given(c.checkpoint.resume_dir)},
      {"--fault-kill-in-save",
       fmt::format("{}:{}", c.checkpoint.kill_rank, c.checkpoint.kill_step)},
      {"--fault-full-disk-in-save",
       fmt::format("{}:{}", c.checkpoint.full_rank, c.checkpoint.full_step)}};
  for (const auto& group : o.flag_groups) {
    const ConfigFields more = group->agreed();
    fields.insert(fields.end(), more.begin(), more.end());
  }
  fields.insert(fields.end(), {{"--check", o.check ? "given" : "not given"},
                               {"--dump", given(o.dump_dir)},
                               {"--json", given(o.json_path)},
                               {"--trace", given(o.trace_path)}});
  return fields;
}

int mesh_degree(int given, MeshFlag newest, MeshFlag flag, int world) {
  if (given != 0) return given;
  if (flag != newest || world % 2 != 0) return 1;
  // Data parallelism alone (stage 07) keeps a TP group of at least 2 at its default.
  return flag == MeshFlag::dp && world < 4 ? 1 : 2;
}

std::string mesh_default_words(MeshFlag newest, MeshFlag flag) {
  if (flag != newest) return "1";
  return flag == MeshFlag::dp ? "2 if the ranks are even and at least 4, else 1"
                              : "2 if the ranks are even, else 1";
}

}  // namespace tpx
