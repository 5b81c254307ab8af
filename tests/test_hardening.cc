// The common machinery's defences against bad numbers, in-process:
//   - --check's comparison fails on a NaN or an infinity planted in any tensor or loss;
//   - numeric flags are parsed strictly (no capping, no wrapping, no empty values) and every
//     error names its flag;
//   - size arithmetic is checked: a config whose counts overflow 64 bits is a config error, and a
//     tensor of such a shape throws instead of wrapping;
//   - a single-device stage rejects the communication flags;
//   - a value the user typed is used or refused, never read as "not given": an empty path or
//     name, a mesh degree or micro-batch count of 0;
//   - a --config file that is not text, or holds a key that is no flag or a value a flag refuses,
//     is refused naming the file and the line; no message echoes a byte a terminal acts on;
//   - an unknown flag is answered with the closest known one ("did you mean --layers?").
// The executables' behaviour (exit codes, every rank agreeing) is in test_startup.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "05_copy_engine_async_tp/flags.h"
#include "07_fsdp_tp/flags.h"
#include "08_context_parallel/flags.h"
#include "09_pipeline_parallel/flags.h"
#include "common/checked.h"
#include "common/cli.h"
#include "common/cli_hint.h"
#include "common/config.h"
#include "common/tensor.h"
#include "common/trainer.h"
#include "test_util.h"

namespace tpx {
namespace {

// --- --check on non-finite values -------------------------------------------------------------

/// A snapshot and a reference that agree exactly (one layer, every gradient present).
struct Agreeing {
  Snapshot got;
  std::vector<StepRow> rows;
  ReferenceRun want;

  Agreeing() {
    const std::vector<float> v{0.5f, -1.25f, 2.0f, 0.125f};
    const std::vector<double> w(v.begin(), v.end());
    got.output = got.input_grad = v;
    want.output = want.input_grad = w;
    got.grads.resize(1);
    want.grads.resize(1);
    for (std::size_t p = 0; p < kNumParams; ++p) {
      got.grads[0][p] = v;
      want.grads[0][p] = w;
    }
    for (double loss : {1.5, 1.25}) {
      StepRow row;
      row.step = int(rows.size());
      row.loss = loss;
      rows.push_back(row);
      want.losses.push_back(loss);
    }
  }

  /// The rows of compare() that failed, by name.
  std::vector<std::string> failures() const {
    std::vector<std::string> names;
    for (const CheckRow& r : compare(got, rows, want, {.rtol = 1e-5}))
      if (!r.ok) names.push_back(r.name);
    return names;
  }
};

TEST(CheckNonFinite, AgreeingTensorsPass) {
  EXPECT_TRUE(Agreeing().failures().empty());
}

TEST(CheckNonFinite, NanInTheOutputFailsNamingIt) {
  Agreeing a;
  a.got.output[2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(a.failures(), std::vector<std::string>{"output"});
  for (const CheckRow& r : compare(a.got, a.rows, a.want, {.rtol = 1e-5})) {
    if (r.name == "output") {
      EXPECT_EQ(r.nonfinite, 1);
    }
  }
}

TEST(CheckNonFinite, InfinityInAGradientFailsNamingIt) {
  Agreeing a;
  a.got.grads[0][static_cast<std::size_t>(Param::w_up)][0] = -INFINITY;
  EXPECT_EQ(a.failures(), std::vector<std::string>{"layers.0.w_up.grad"});
}

TEST(CheckNonFinite, NanLossFailsNamingTheStep) {
  Agreeing a;
  a.rows[1].loss = NAN;
  EXPECT_EQ(a.failures(), std::vector<std::string>{"loss after 1 update"});
}

TEST(CheckNonFinite, NanInTheReferenceFailsToo) {
  Agreeing a;
  a.want.input_grad[0] = NAN;
  EXPECT_EQ(a.failures(), std::vector<std::string>{"input.grad"});
}

TEST(CheckNonFinite, AMissingLossFails) {
  Agreeing a;
  a.rows.pop_back();  // the run stopped before the reference's last step
  EXPECT_EQ(a.failures(), std::vector<std::string>{"loss after 1 update"});
}

// --- strict flags ------------------------------------------------------------------------------

/// parse_stage_cli on "prog <args...>".
CliOutcome parse(std::vector<std::string> args, bool single_device = false) {
  args.insert(args.begin(), "prog");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const StageInfo info{.name = "prog", .summary = "test", .single_device = single_device};
  return parse_stage_cli(info, static_cast<int>(args.size()), argv.data());
}

void expect_error(const std::vector<std::string>& args, const std::vector<std::string>& must_name,
                  bool single_device = false) {
  const CliOutcome r = parse(args, single_device);
  EXPECT_FALSE(r.options.has_value()) << "accepted: " << testing::PrintToString(args);
  EXPECT_EQ(r.exit_code, 2);
  for (const auto& s : must_name)
    EXPECT_NE(r.message.find(s), std::string::npos) << "'" << r.message << "' lacks " << s;
}

TEST(StrictFlags, ValuesAboveTheTypesRangeAreErrorsNotCapped) {
  expect_error({"--ffn", "99999999999999999999"}, {"--ffn", "99999999999999999999", "range"});
  expect_error({"--seed", "18446744073709551616"}, {"--seed", "range"});
  expect_error({"--lr", "1e999"}, {"--lr", "range"});
}

TEST(StrictFlags, NegativeSeedIsAnErrorNotWrapped) {
  expect_error({"--seed", "-1"}, {"--seed", "-1"});
}

TEST(StrictFlags, EmptyValuesAreErrors) {
  for (const char* flag : {"--hidden", "--seq", "--steps", "--lr", "--seed", "--comm-timeout"})
    expect_error({flag, ""}, {flag, "empty"});
}

TEST(StrictFlags, TrailingGarbageAndNonFiniteAreErrors) {
  expect_error({"--hidden", "64k"}, {"--hidden", "64k"});
  expect_error({"--heads", "4.0"}, {"--heads"});
  expect_error({"--lr", "nan"}, {"--lr", "nan"});
  expect_error({"--lr", "inf"}, {"--lr"});
  expect_error({"--comm-timeout", "0.5s"}, {"--comm-timeout"});
}

TEST(StrictFlags, TheWholeRangeIsAccepted) {
  const CliOutcome r = parse({"--seed", "18446744073709551615", "--lr", "2.5e-3", "--steps", "7"});
  ASSERT_TRUE(r.options.has_value()) << r.message;
  EXPECT_EQ(r.options->config.seed, std::numeric_limits<std::uint64_t>::max());
  EXPECT_EQ(r.options->config.lr, 2.5e-3);
  EXPECT_EQ(r.options->config.steps, 7);
}

TEST(StrictFlags, FaultInjectionErrorsNameTheFlag) {
  expect_error({"--fault-skip-collective", "x"}, {"--fault-skip-collective", "RANK:SEQ"});
  expect_error({"--fault-skip-collective", "1:"}, {"--fault-skip-collective"});
  expect_error({"--fault-skip-collective", "a:3"}, {"--fault-skip-collective"});
  expect_error({"--fault-skip-collective", "-1:3"}, {"--fault-skip-collective"});
  expect_error({"--fault-comm-delay-us", "x"}, {"--fault-comm-delay-us"});
  expect_error({"--fault-comm-delay-us", "1.5"}, {"--fault-comm-delay-us"});
  const CliOutcome ok = parse({"--fault-skip-collective", "1:7", "--fault-comm-delay-us", "250"});
  ASSERT_TRUE(ok.options.has_value()) << ok.message;
  EXPECT_EQ(ok.options->comm.fault_rank, 1);
  EXPECT_EQ(ok.options->comm.fault_seq, 7);
  EXPECT_EQ(ok.options->comm.comm_delay_us, 250);
}

TEST(StrictFlags, OnlyACopyEngineStageTakesAllGather) {
  std::vector<std::string> args{"prog", "--all-gather", "nccl-zero-cta", "--device", "cuda"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  // Stage 05's flag group (stage 06 names it too).
  const StageInfo copy_engine{
      .name = "prog", .summary = "test", .flag_groups = {async_tp::AllGatherFlags::make}};
  const CliOutcome ok = parse_stage_cli(copy_engine, 5, argv.data());
  ASSERT_TRUE(ok.options.has_value()) << ok.message;
  EXPECT_EQ(ok.options->flags<async_tp::AllGatherFlags>().path(),
            async_tp::AllGatherPath::nccl_zero_cta);
  // Ranks must agree on it like on any flag that decides which collectives run.
  const ConfigFields fields = config_fields(copy_engine, *ok.options);
  EXPECT_TRUE(std::ranges::any_of(fields, [](const auto& f) {
    return f.first == "--all-gather" && f.second == "nccl-zero-cta";
  }));
  // NCCL's all-gather moves GPU memory: refused on the cpu, naming the path that runs there.
  const CliOutcome cpu = parse_stage_cli(copy_engine, 3, argv.data());
  EXPECT_EQ(cpu.exit_code, 2);
  EXPECT_NE(cpu.message.find("cannot run on the cpu"), std::string::npos) << cpu.message;
  EXPECT_NE(cpu.message.find("--all-gather pulls"), std::string::npos) << cpu.message;
  args[2] = "nccl";
  argv.clear();
  for (auto& a : args) argv.push_back(a.data());
  const CliOutcome bad = parse_stage_cli(copy_engine, 3, argv.data());
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.message.find("--all-gather"), std::string::npos) << bad.message;
  // Other stages have no all-gather to choose: the flag is unknown there, and not in --help.
  expect_error({"--all-gather", "pulls"}, {"--all-gather"});
  EXPECT_EQ(parse({"--help"}).message.find("--all-gather"), std::string::npos);
}

TEST(StrictFlags, ASingleDeviceStageRejectsCommunicationFlags) {
  for (const char* flag : {"--comm", "--comm-timeout"}) {
    const std::string value = std::string(flag) == "--comm" ? "nccl" : "5";
    expect_error({flag, value}, {flag, "prog", "one device"}, /*single_device=*/true);
    EXPECT_TRUE(parse({flag, value}).options.has_value()) << "multi-rank stages take " << flag;
  }
  expect_error({"--fault-skip-collective", "0:1"}, {"--fault-skip-collective"}, true);
  expect_error({"--fault-comm-delay-us", "5"}, {"--fault-comm-delay-us", "one device"}, true);
  EXPECT_EQ(parse({"--help"}, true).message.find("--comm"), std::string::npos)
      << "--help of a single-device stage lists --comm";
}

// --- given values are used or refused ----------------------------------------------------------

/// parse_stage_cli of stage 09's flag groups (--dp, --cp, --pp, --microbatches, ...).
CliOutcome parse_mesh_stage(std::vector<std::string> args) {
  args.insert(args.begin(), "prog");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  const StageInfo info{.name = "prog",
                       .summary = "test",
                       .flag_groups = {fsdp::DataParallelFlags::make,
                                       cp::ContextParallelFlags::make, pp::PipelineFlags::make}};
  return parse_stage_cli(info, static_cast<int>(args.size()), argv.data());
}

TEST(GivenValues, AnEmptyPathOrNameIsRefusedNotTakenAsNotGiven) {
  // The output paths reach output.h's own check of an empty path.
  for (const char* flag : {"--json", "--trace", "--dump"}) {
    expect_error({flag, ""}, {std::string(flag) + ": the path is empty"});
    expect_error({fmt::format("{}=", flag)}, {flag});  // CLI11: a value is missing
  }
  expect_error({"--config", ""}, {"--config: the path is empty"});
  expect_error({"--model", ""}, {"--model", "empty", "llama3-8b"});
}

TEST(GivenValues, ZeroOrANegativeMeshDegreeIsRefusedNotTakenAsTheDefault) {
  for (const char* flag : {"--pp", "--dp", "--cp", "--microbatches", "--stages-per-rank"})
    for (const char* value : {"0", "-1"}) {
      SCOPED_TRACE(fmt::format("{} {}", flag, value));
      const CliOutcome r = parse_mesh_stage({flag, value});
      EXPECT_FALSE(r.options.has_value());
      EXPECT_EQ(r.exit_code, 2);
      EXPECT_NE(r.message.find(fmt::format("{} '{}': must be a positive number", flag, value)),
                std::string::npos)
          << r.message;
      // And says what leaving it out gives.
      EXPECT_NE(r.message.find(fmt::format("leave {} out for its default", flag)),
                std::string::npos)
          << r.message;
    }
  // Left out, they are the defaults; given, the values.
  const CliOutcome none = parse_mesh_stage({});
  ASSERT_TRUE(none.options.has_value()) << none.message;
  EXPECT_EQ(none.options->flags<pp::PipelineFlags>().pp, 0);
  EXPECT_EQ(none.options->flags<pp::PipelineFlags>().microbatches, 0);
  const CliOutcome given = parse_mesh_stage({"--pp", "2", "--dp", "1", "--microbatches", "4"});
  ASSERT_TRUE(given.options.has_value()) << given.message;
  EXPECT_EQ(given.options->flags<pp::PipelineFlags>().pp, 2);
  EXPECT_EQ(given.options->flags<fsdp::DataParallelFlags>().dp, 1);
  EXPECT_EQ(given.options->flags<pp::PipelineFlags>().microbatches, 4);
  // --help does not advertise 0 as a value.
  EXPECT_EQ(parse_mesh_stage({"--help"}).message.find("--pp P=0"), std::string::npos);
}

// --- --config files and bytes a terminal acts on -------------------------------------------------

TEST(Printable, ControlBytesAndBrokenUtf8AreEscapedPrintableUtf8IsKept) {
  EXPECT_EQ(printable("P 2 × D 1 … ok"), "P 2 × D 1 … ok");
  EXPECT_EQ(printable("a\x1b[2Jb"), "a\\x1b[2Jb");
  EXPECT_EQ(printable("tab\there\n"), "tab\\there\\x0a");
  EXPECT_EQ(printable("\x7f"), "\\x7f");
  EXPECT_EQ(printable("\xc2\x9b"), "\\xc2\\x9b");           // U+009B, a C1 control (CSI)
  EXPECT_EQ(printable("\xff\xc3"), "\\xff\\xc3");           // not UTF-8; a cut sequence
  EXPECT_EQ(printable("\xe0\x80\xaf"), "\\xe0\\x80\\xaf");  // overlong '/'
  EXPECT_EQ(unprintable_at("ok ×"), std::string::npos);
  EXPECT_EQ(unprintable_at("ok\x1b"), 2u);
}

TEST(ConfigFiles, ABinaryFileIsRefusedNamingTheFileAndLineWithoutEchoingIt) {
  test::TempDir dir;
  struct Case {
    std::string name, bytes, words;
  };
  std::string junk = "hidden = 64\n";
  for (int i = 0; i < 256; ++i) junk += char((i * 37 + 11) % 256);  // every byte value
  for (const Case& c :
       {Case{"junk.bin", junk, "line 2, column "},
        Case{"escape.toml", "hidden = 64\n\x1b[31mred\x1b[0m = 3\n", "line 2, column 1: byte 0x1b"},
        Case{"value.toml", "# sizes\nheads = 4\nhidden = \x1b]0;title\x07\n", "line 3, column 10"},
        Case{"c1.toml",
             "hidden = 6\xc2\x9b"
             "4\n",
             "line 1, column 11: byte 0xc2"}}) {
    SCOPED_TRACE(c.name);
    const std::string path = (dir / c.name).string();
    { std::ofstream(path, std::ios::binary) << c.bytes; }
    const CliOutcome r = parse({"--config", path});
    EXPECT_FALSE(r.options.has_value());
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_NE(r.message.find(fmt::format("--config '{}' ", path)), std::string::npos) << r.message;
    EXPECT_NE(r.message.find(c.words), std::string::npos) << r.message;
    EXPECT_EQ(unprintable_at(r.message), std::string::npos) << printable(r.message);
  }
}

TEST(ConfigFiles, AKeyOrAValueTheStageRefusesIsNamedWithItsLine) {
  test::TempDir dir;
  const std::string path = (dir / "run.toml").string();
  auto refused = [&](const std::string& text, std::vector<std::string> args) {
    { std::ofstream(path) << text; }
    args.insert(args.begin(), {"--config", path});
    const CliOutcome r = parse(args);
    EXPECT_FALSE(r.options.has_value()) << text;
    EXPECT_EQ(r.exit_code, 2);
    return r.message;
  };
  const std::string key = refused("# a run\nhidden = 64\n\n  layrs = 3\n", {});
  EXPECT_NE(key.find(fmt::format("--config '{}' line 4: 'layrs' is not a flag", path)),
            std::string::npos)
      << key;
  EXPECT_NE(key.find("did you mean layers?"), std::string::npos) << key;
  const std::string value = refused("hidden = 64\r\nheads\t= x\r\n", {});
  EXPECT_NE(value.find(fmt::format("--config '{}' line 2: --heads 'x': not an integer", path)),
            std::string::npos)
      << value;
  // The command line wins over the file: its own bad value is not blamed on the file.
  const std::string flag = refused("hidden = 64\nheads = 4\n", {"--heads", "y"});
  EXPECT_EQ(flag.find("--config"), std::string::npos) << flag;
  EXPECT_NE(flag.find("--heads 'y'"), std::string::npos) << flag;
  // A directory or a missing file: named as --config's.
  const CliOutcome missing = parse({"--config", dir.path().string()});
  EXPECT_NE(missing.message.find(fmt::format("--config '{}'", dir.path().string())),
            std::string::npos)
      << missing.message;
  // A good file with tabs, CRLF and UTF-8 comments parses.
  { std::ofstream(path) << "# P × D\r\nhidden\t= 64\r\nheads = 4\r\n"; }
  const CliOutcome ok = parse({"--config", path});
  ASSERT_TRUE(ok.options.has_value()) << ok.message;
  EXPECT_EQ(ok.options->config.hidden, 64);
  EXPECT_EQ(ok.options->config.heads, 4);
}

TEST(ConfigFiles, NoMessageEchoesATerminalsControlBytes) {
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--hidden", "\x1b[2J"},
                                               {"--model", "\x1b[31mred"},
                                               {"--dtype", "\x1b]0;x\x07"},
                                               {"--bogus\x1b[1m"}}) {
    const CliOutcome r = parse(args);
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_EQ(unprintable_at(r.message), std::string::npos) << printable(r.message);
    EXPECT_NE(r.message.find("\\x1b"), std::string::npos) << r.message;
  }
}

// --- checked sizes -----------------------------------------------------------------------------

TEST(CheckedSizes, ProductsThatOverflowAreCaught) {
  constexpr auto big = std::numeric_limits<std::int64_t>::max();
  EXPECT_EQ(checked_mul<std::int64_t>(big / 2, 2), big - 1);
  EXPECT_FALSE(checked_mul<std::int64_t>(big / 2 + 1, 2).has_value());
  EXPECT_FALSE(checked_add<std::uint64_t>(~0ull, 1).has_value());
  EXPECT_EQ(checked_product({3, 5, 7}, "x"), 105);
  EXPECT_THROW(checked_product({1ll << 32, 1ll << 31}, "x"), SizeOverflow);
}

TEST(CheckedSizes, AConfigWhoseCountsOverflowIsAConfigError) {
  BlockConfig c;
  c.seq = 4611686018427387903;  // 2^62 − 1: S·B·H·4 bytes and B·NH·S² overflow
  c.batch = c.heads = c.ffn = 1;
  c.hidden = 2;  // an even head dim, as the rotary embedding needs
  const auto errors = validate(c);
  ASSERT_FALSE(errors.empty());
  EXPECT_NE(errors[0].find("too large"), std::string::npos) << errors[0];

  BlockConfig ok;  // the default config's counts are far from the limit
  EXPECT_TRUE(validate(ok).empty());
}

TEST(CheckedSizes, ATensorWhoseCountOverflowsThrowsInsteadOfWrapping) {
  EXPECT_THROW((void)Tensor::empty({1ll << 40, 1ll << 40}), SizeOverflow);
  // 2^61 elements fit in int64, their 2^63 bytes do not.
  EXPECT_THROW((void)Tensor::empty({1ll << 31, 1ll << 30}, DType::f32).nbytes(), Error);
}

// --- did you mean ------------------------------------------------------------------------------

TEST(UnknownFlags, TheClosestFlagIsSuggested) {
  const std::vector<std::string> known = {"--hidden", "--heads", "--kv-heads", "--layers",
                                          "--seq",    "--steps", "--dump",     "--dtype"};
  EXPECT_EQ(closest_flag("--layer", known), "--layers");        // a letter left out
  EXPECT_EQ(closest_flag("--haeds", known), "--heads");         // two letters swapped
  EXPECT_EQ(closest_flag("-layers", known), "--layers");        // one dash
  EXPECT_EQ(closest_flag("--kv-head=2", known), "--kv-heads");  // with a value
  EXPECT_EQ(closest_flag("--hid", known), "--hidden");          // an unambiguous prefix
  EXPECT_EQ(closest_flag("--s", known), "");                    // too short to guess
  EXPECT_EQ(closest_flag("--bogus", known), "");                // nothing near
  EXPECT_EQ(closest_flag("--layers", known), "");               // known: not a slip
}

TEST(UnknownFlags, TheParseErrorNamesTheFlagAndTheSuggestion) {
  const CliOutcome out = parse({"--layer", "3"});
  ASSERT_FALSE(out.options);
  EXPECT_EQ(out.exit_code, 2);
  EXPECT_NE(out.message.find("--layer: did you mean --layers?"), std::string::npos) << out.message;
  EXPECT_EQ(out.message.find('\n'), std::string::npos) << out.message;  // one line
  // Hidden flags (fault injection) are not suggested, and far-off flags get no guess.
  const CliOutcome far = parse({"--zzzzzz"});
  EXPECT_EQ(far.message.find("did you mean"), std::string::npos) << far.message;
  const CliOutcome hidden = parse({"--fault-skip-collectiv", "1:2"});
  EXPECT_EQ(hidden.message.find("did you mean"), std::string::npos) << hidden.message;
}

}  // namespace
}  // namespace tpx
