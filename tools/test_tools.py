#!/usr/bin/env python3
"""Tests of the reporting tools on inputs written here by hand (never a program's own output as
the expected value). Run by ctest (tools.reports_and_errors):

    python3 tools/test_tools.py BUILD_DIR

  - tpx_report's CSV parses with Python's csv reader into rows as long as the header (RFC 4180:
    a field holding commas or quotes stays one field), carries each run's config, mesh and device
    string, and its markdown table shows the config and bytes in binary units; a field that is
    missing, of another type or out of range (or a mesh that does not cover the ranks) is one
    line naming the file and the field, and a CSV that cannot be written whole (a file-size
    limit) is not written at all;
  - trace_svg titles the drawing with the stage, ranks and step, and shades exactly the interval
    in which a rank communicates and computes nothing; a pipeline's step runs between its
    updates, with its F, B and W actions drawn;
  - mesh_svg writes each group's bytes of stage 09's summary (TP the step's bytes less the other
    three's) and plot_pipeline plots a summary's bubble and live counts, refusing a summary of
    another stage;
  - a path that cannot be read or written is one line and exit status 2, never a traceback, for
    tpx_report and for the Python tools (trace_svg, signal_svg, plot_losses, plot_memory,
    plot_pipeline, mesh_svg, bench, recompute_sweep).
"""
import csv
import json
import pathlib
import re
import resource
import subprocess
import sys
import tempfile
import unittest

TOOLS = pathlib.Path(__file__).resolve().parent
BUILD = pathlib.Path(sys.argv.pop(1) if len(sys.argv) > 1 else "build")
DEVICE = "cpu: Test CPU (cpu family 1, model 2, stepping 3), 2 cores"


def summary(hidden, comm, world=2, dp=1, peak=16 * 1024 * 1024, check=None):
    """A --json summary with the fields tpx_report reads; two steps, the first warms up."""
    steps = [{"loss": 1.5, "ms": 100.0, "exposed_comm_ms": 9.0, "comm_payload_bytes": 0,
              "comm_bus_bytes": 0, "peak_bytes": peak},
             {"loss": 1.25, "ms": 20.0, "exposed_comm_ms": 2.0, "comm_payload_bytes": 3 * 1024,
              "comm_bus_bytes": 3 * 1024 * 1024, "peak_bytes": peak}]
    j = {"stage": "07_fsdp_tp" if dp > 1 else "02_megatron_tp", "world_size": world, "dp": dp,
         "comm": comm, "device_description": DEVICE, "saved_activation_bytes": 512,
         "config": {"hidden": hidden, "heads": 8, "kv_heads": 2, "ffn": 4 * hidden, "seq": 64,
                    "batch": 2, "layers": 3, "device": "cpu", "dtype": "bf16"},
         "steps": steps}
    if check is not None:
        j["check"] = {"pass": check}
    return j


def run(cmd):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=60)


class Report(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.tmp = pathlib.Path(self.dir.name)
        self.exe = BUILD / "bin" / "tpx_report"

    def tearDown(self):
        self.dir.cleanup()

    def write(self, name, j):
        p = self.tmp / name
        p.write_text(json.dumps(j))
        return p

    def test_csv_rows_are_as_long_as_the_header_and_keep_each_config(self):
        a = self.write("a.json", summary(256, 'mpi (host-staged: ranks 0 and 1 share a GPU, "x")'))
        b = self.write("b.json", summary(512, "mpi (host memory)", world=4, dp=2, check=True))
        out = self.tmp / "t.csv"
        r = run([self.exe, a, b, "--csv", out])
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(out, newline="") as f:  # as the csv module asks: it reads the CRLFs itself
            rows = list(csv.reader(f))
        head, body = rows[0], rows[1:]
        self.assertEqual(len(body), 2)
        for row in body:
            self.assertEqual(len(row), len(head), row)
        first, second = (dict(zip(head, row)) for row in body)
        self.assertEqual(first["comm"], 'mpi (host-staged: ranks 0 and 1 share a GPU, "x")')
        self.assertEqual((first["hidden"], second["hidden"]), ("256", "512"))
        self.assertEqual((first["ffn"], first["kv_heads"], first["layers"]), ("1024", "2", "3"))
        self.assertEqual(first["device"], DEVICE)
        self.assertEqual((first["mesh"], second["mesh"]), ("tp2", "dp2 × tp2"))

        self.assertEqual((second["dp"], second["tp"]), ("2", "2"))
        # Raw numbers in the CSV: the steady step's bytes, not a unit.
        self.assertEqual(first["bus_bytes_per_rank"], str(3 * 1024 * 1024))
        self.assertEqual(first["peak_bytes"], str(16 * 1024 * 1024))
        self.assertEqual(float(first["step_ms"]), 20.0)  # step 0 warms up
        self.assertEqual((first["check"], second["check"]), ("-", "PASS"))

        # The markdown: the config in each row, bytes in binary units, one device line.
        self.assertIn("H 256 NH 8 NKV 2 F 1024 S 64 B 2 L 3", r.stdout)
        self.assertIn("H 512 NH 8 NKV 2 F 2048 S 64 B 2 L 3", r.stdout)
        self.assertIn(f"Device: {DEVICE}.", r.stdout)
        row = next(ln for ln in r.stdout.splitlines() if ln.startswith("| 02_megatron_tp"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        self.assertIn("3.0 MiB", cells)     # bus bytes per rank
        self.assertIn("3.0 KiB", cells)     # payload
        self.assertIn("16.0 MiB", cells)    # peak
        self.assertIn("512 B", cells)       # saved activations
        self.assertNotIn(str(3 * 1024 * 1024), row)

    def test_the_experts_ep_is_in_the_mesh_and_must_divide_dp(self):
        j = summary(256, "mpi (host memory)", world=8, dp=4)
        j["stage"], j["moe"] = "10_expert_parallel", {"ep": 2, "experts": 8}
        out = self.tmp / "t.csv"
        r = run([self.exe, self.write("e.json", j), "--csv", out])
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(out, newline="") as f:
            rows = list(csv.reader(f))
        self.assertEqual(dict(zip(rows[0], rows[1]))["mesh"], "dp4 × tp2, ep2")
        for moe, says in [({"ep": 3}, "moe.ep 3 does not divide dp 4"),
                          ({"ep": 0}, "moe.ep is 0"), ({"ep": "2"}, "moe.ep is \"2\""),
                          ({"ep": 2 ** 63}, "moe.ep is 9223372036854775808"),
                          ([2], "moe is [2]: it must be an object")]:
            j["moe"] = moe
            r = run([self.exe, self.write("bad.json", j)])
            self.assertEqual(r.returncode, 2, moe)
            self.assertIn(says, r.stderr, moe)
            self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)

    def test_bad_input_is_one_line_and_exit_2(self):
        good = self.write("a.json", summary(256, "mpi"))
        notjson = self.tmp / "x.json"
        notjson.write_text("{")
        nosteps = self.write("n.json", {"stage": "x"})
        for args, says in [([self.tmp / "missing.json"], "cannot read"),
                           ([notjson], "is not JSON"),
                           ([nosteps], "is not a stage's --json summary"),
                           # checked before any input is read
                           ([good, "--csv", self.tmp / "no" / "dir" / "t.csv"],
                            "--csv '{}': directory '{}' does not exist".format(
                                self.tmp / "no" / "dir" / "t.csv", self.tmp / "no" / "dir")),
                           ([good, "--cvs", "t.csv"], "did you mean --csv?"),
                           # the CSV over one of its own inputs: refused before anything is read
                           (["--csv", good, good, self.tmp / "b.json"],
                            "would overwrite the input")]:
            r = run([self.exe] + args)
            self.assertEqual(r.returncode, 2, (args, r.stderr))
            lines = r.stderr.strip().splitlines()
            self.assertEqual(len(lines), 1, r.stderr)
            self.assertTrue(lines[0].startswith("tpx_report: error: "), lines[0])
            self.assertIn(says, lines[0])
        self.assertEqual(json.loads(good.read_text())["stage"], summary(256, "mpi")["stage"])

    def test_a_field_out_of_range_is_one_line_naming_the_file_and_the_field(self):
        def edited(edit):
            j = summary(256, "mpi")
            edit(j)
            return j
        cases = [  # (the summary, what the line names)
            (edited(lambda j: j.update(world_size=1e30)), "world_size is 1e+30"),
            (edited(lambda j: j.update(world_size=2.5)), "world_size is 2.5"),
            (edited(lambda j: j["config"].update(hidden=1e300)), "config.hidden is 1e+300"),
            (edited(lambda j: j["config"].update(heads="8")), 'config.heads is "8"'),
            (edited(lambda j: j["config"].update(batch=0)), "config.batch is 0"),
            (edited(lambda j: j["config"].update(kv_heads=3)), "config.kv_heads 3 does not divide"),
            (edited(lambda j: j["steps"][1].update(peak_bytes=-5)), "steps[1].peak_bytes is -5"),
            (edited(lambda j: j["steps"][1].update(ms=-1.0)), "steps[1].ms is -1"),
            (edited(lambda j: j["steps"][0].update(loss=None)), "steps[0].loss is null"),
            (edited(lambda j: j.update(saved_activation_bytes=2 ** 63)),
             "saved_activation_bytes is 9223372036854775808"),
            (edited(lambda j: j.pop("world_size")), "has no world_size"),
            (edited(lambda j: j.update(pp=0)), "pp is 0"),
            (edited(lambda j: j.update(dp=0)), "dp is 0"),
            # A P2 run's mesh must cover its ranks: pp·dp·cp divides world_size.
            (edited(lambda j: j.update(world_size=3, dp=2)), "world_size 3 is not a multiple"),
            (edited(lambda j: j.update(check={"pass": 1})), "check.pass is 1"),
        ]
        for j, says in cases:
            path = self.write("f.json", j)
            r = run([self.exe, path])
            self.assertEqual(r.returncode, 2, (says, r.stdout, r.stderr))
            lines = r.stderr.strip().splitlines()
            self.assertEqual(len(lines), 1, r.stderr)
            self.assertTrue(lines[0].startswith(f"tpx_report: error: '{path}'"), lines[0])
            self.assertIn(says, lines[0])
            self.assertEqual(r.stdout, "")
        # A directory is not a summary: one line, not an uncaught stream error.
        r = run([self.exe, self.tmp])
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertEqual(r.stderr.strip(),
                         f"tpx_report: error: cannot read '{self.tmp}': it is a directory, "
                         "not a --json file")

    def test_a_csv_that_cannot_be_written_whole_is_not_written_at_all(self):
        # 40 rows of some 300 bytes under a 4 KiB file-size limit: the write fails part-way.
        inputs = [self.write(f"r{i}.json", summary(256, "mpi")) for i in range(40)]
        old, new = self.tmp / "old.csv", self.tmp / "new.csv"
        old.write_text("old content\n")
        before = sorted(p.name for p in self.tmp.iterdir())

        def limited(csv_path):
            def limit():
                resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
            return subprocess.run([str(c) for c in [self.exe, *inputs, "--csv", csv_path]],
                                  capture_output=True, text=True, timeout=60, preexec_fn=limit)
        for path in (old, new):
            r = limited(path)
            self.assertEqual(r.returncode, 2, (path, r.stderr))
            self.assertEqual(r.stderr.strip().splitlines(),
                             [f"tpx_report: error: cannot write '{path}': File too large"])
        self.assertEqual(old.read_text(), "old content\n")  # the old file kept whole
        self.assertEqual(sorted(p.name for p in self.tmp.iterdir()), before)  # nothing left


def trace(events, stage="04_overlap_ring", world=2):
    """A --trace file: complete events (ts, dur in µs) on lanes 0 compute, 1 comm, 3 phases."""
    evs = [{"name": n, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur}
           for n, pid, tid, ts, dur in events]
    return {"traceEvents": evs, "otherData": {"stage": stage, "world_size": world}}


class TraceSvg(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.tmp = pathlib.Path(self.dir.name)

    def tearDown(self):
        self.dir.cleanup()

    def test_title_and_the_exposed_interval(self):
        # Rank 0 computes 0–1 ms and 2–3 ms and communicates 0.5–2.5 ms: exposed 1–2 ms. Rank 1
        # computes 0–3 ms while it communicates 0.5–2.5 ms: nothing exposed.
        t = trace([("forward", 0, 3, 0, 3000), ("update", 0, 3, 3000, 100),
                   ("forward", 1, 3, 0, 3000), ("update", 1, 3, 3000, 100),
                   ("qkv GEMM", 0, 0, 0, 1000), ("o GEMM", 0, 0, 2000, 1000),
                   ("qkv ag step 1/2", 0, 1, 500, 2000),
                   ("qkv GEMM", 1, 0, 0, 3000), ("qkv ag step 1/2", 1, 1, 500, 2000)])
        src, svg = self.tmp / "t.json", self.tmp / "t.svg"
        src.write_text(json.dumps(t))
        r = run([sys.executable, TOOLS / "trace_svg.py", src, "--step", "0", "--phase", "forward",
                 "-o", svg])
        self.assertEqual(r.returncode, 0, r.stderr)
        text = svg.read_text()
        title = re.search(r"<title>(.*?)</title>", text).group(1)
        self.assertEqual(title, "04_overlap_ring, 2 ranks: forward of step 0")
        self.assertIn(">04_overlap_ring, 2 ranks: forward of step 0</text>", text)  # drawn too
        shaded = re.findall(r"<title>rank (\d): exposed comm ([\d.]+) ms, at ([\d.]+) ms</title>",
                            text)
        self.assertEqual(shaded, [("0", "1.000", "1.000")])
        self.assertIn("exposed comm (no compute beside it)", text)  # in the legend

    def test_a_pipelines_step_runs_between_updates_with_its_actions_drawn(self):
        # Stage 09 has no "forward" span: step 1 is rank 0's F1 at 10 ms (after step 0's update,
        # 5–6 ms) to the end of the second update, 20 ms; F1 and B1 drawn on the actions row.
        t = trace([("F0", 0, 3, 0, 2000), ("B0", 0, 3, 2000, 3000), ("update", 0, 3, 5000, 1000),
                   ("F1", 0, 3, 10000, 2000), ("W1", 0, 3, 12000, 1000),
                   ("B1", 0, 3, 13000, 3000), ("update", 0, 3, 19000, 1000),
                   ("qkv GEMM", 0, 0, 10000, 2000)], stage="09_pipeline_parallel", world=1)
        src, svg = self.tmp / "t.json", self.tmp / "t.svg"
        src.write_text(json.dumps(t))
        r = run([sys.executable, TOOLS / "trace_svg.py", src, "--step", "1", "-o", svg])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("window 10.000 .. 20.000 ms", r.stderr)
        text = svg.read_text()
        self.assertIn("<title>F1: 2.000 ms, at 0.000 ms</title>", text)
        self.assertIn("<title>B1: 3.000 ms, at 3.000 ms</title>", text)
        self.assertNotIn("<title>F0:", text)
        self.assertIn(">rank 0 phases</text>", text)
        for key in ("F: forward", "B: backward", "W: weight grads"):
            self.assertIn(f">{key}</text>", text)
        r = run([sys.executable, TOOLS / "trace_svg.py", src, "--step", "2", "-o", svg])
        self.assertEqual(r.returncode, 2)
        self.assertIn("rank 0 has 2 update spans; no step 2", r.stderr)

    def test_bad_paths_are_one_line_and_exit_2(self):
        src = self.tmp / "t.json"
        src.write_text(json.dumps(trace([("forward", 0, 3, 0, 10), ("update", 0, 3, 10, 5),
                                         ("x GEMM", 0, 0, 0, 10)])))
        notjson = self.tmp / "bad.json"
        notjson.write_text("[1,")
        cases = [
            ([TOOLS / "trace_svg.py", src, "-o", self.tmp / "missing" / "dir" / "x.svg"],
             "missing/dir/x.svg"),
            ([TOOLS / "trace_svg.py", self.tmp / "nope.json", "-o", self.tmp / "x.svg"],
             "nope.json"),
            ([TOOLS / "trace_svg.py", notjson, "-o", self.tmp / "x.svg"], "not JSON"),
            ([TOOLS / "signal_svg.py", self.tmp / "nope.json", "-o", self.tmp / "x.svg"],
             "nope.json"),
            ([TOOLS / "plot_losses.py", f"{self.tmp / 'nope.json'}:a", "-o", self.tmp / "x.svg"],
             "nope.json"),
            ([TOOLS / "plot_memory.py", f"{self.tmp / 'nope.json'}:a", "-o", self.tmp / "x.svg"],
             "nope.json"),
            ([TOOLS / "plot_pipeline.py", "bubble", self.tmp / "nope.json", "-o",
              self.tmp / "x.svg"], "nope.json"),
            ([TOOLS / "mesh_svg.py", self.tmp / "nope.json", "-o", self.tmp / "x.svg"],
             "nope.json"),
            ([TOOLS / "vocab_svg.py", "-o", self.tmp / "missing" / "dir" / "x.svg"],
             "missing/dir/x.svg"),
            ([TOOLS / "bench.py", "--build", self.tmp / "nobuild"], "nobuild: no such directory"),
            ([TOOLS / "recompute_sweep.py", "--build", self.tmp / "nobuild"], "nobuild/bin"),
        ]
        for cmd, says in cases:
            r = run([sys.executable] + cmd)
            tool = pathlib.Path(cmd[0]).stem
            self.assertEqual(r.returncode, 2, (cmd, r.stderr))
            self.assertNotIn("Traceback", r.stderr)
            lines = r.stderr.strip().splitlines()
            self.assertEqual(len(lines), 1, r.stderr)
            self.assertTrue(lines[0].startswith(f"{tool}: error: "), lines[0])
            self.assertIn(says, lines[0])


class PipelineFigures(unittest.TestCase):
    """mesh_svg and plot_pipeline on a stage 09 summary written here."""

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.tmp = pathlib.Path(self.dir.name)
        step = {"comm_bus_bytes": 1000, "cp_bus_bytes": 100, "dp_bus_bytes": 300,
                "pp_bus_bytes": 50, "peak_bytes": 3 * 1048576}
        self.run_json = self.tmp / "p.json"
        self.run_json.write_text(json.dumps({
            "world_size": 16, "dp": 2, "cp": 2, "steps": [step],
            "pipeline": {"pp": 2, "schedule": "1f1b", "stages_per_rank": 1, "microbatches": 4,
                         "bubble_measured": 0.25, "bubble_formula": 0.2, "live_peak": [2, 1]}}))

    def tearDown(self):
        self.dir.cleanup()

    def test_mesh_svg_draws_every_rank_and_each_groups_bytes(self):
        out = self.tmp / "m.svg"
        r = run([sys.executable, TOOLS / "mesh_svg.py", self.run_json, "--title", "t", "-o", out])
        self.assertEqual(r.returncode, 0, r.stderr)
        text = out.read_text()
        for rank in range(16):  # P 2 × D 2 × C 2 × T 2
            self.assertIn(f'text-anchor="middle">{rank}</text>', text)
        self.assertIn("the block's collectives: 550 B", text)  # 1000 − 100 − 300 − 50
        self.assertIn("K/V blocks: 100 B", text)
        self.assertIn("reduce-scatters: 300 B", text)
        self.assertIn("PP neighbour (rank 8): activations and their gradients: 50 B", text)

    def test_plot_pipeline_plots_the_summary_and_refuses_another_stage(self):
        out = self.tmp / "b.svg"
        r = run([sys.executable, TOOLS / "plot_pipeline.py", "bubble", self.run_json, "-o", out])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("1f1b M 4: measured 0.250, formula 0.200", out.read_text())
        r = run([sys.executable, TOOLS / "plot_pipeline.py", "live", f"{self.run_json}:x", "-o",
                 out])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("peak 3.0 MiB", out.read_text())
        other = self.tmp / "o.json"
        other.write_text(json.dumps({"steps": []}))
        r = run([sys.executable, TOOLS / "plot_pipeline.py", "live", other, "-o", out])
        self.assertEqual(r.returncode, 2)
        self.assertIn("not a 09_pipeline_parallel --json", r.stderr)


class MoeFigures(unittest.TestCase):
    """moe_svg on stage 10 summaries written here."""

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.tmp = pathlib.Path(self.dir.name)

    def tearDown(self):
        self.dir.cleanup()

    def summary(self, name, counts):
        path = self.tmp / name
        path.write_text(json.dumps({"steps": [{}] * len(counts),
                                    "moe": {"experts": 4, "ep": 2, "layers": [0],
                                            "tokens_per_expert": [[c] for c in counts]}}))
        return path

    def test_balance_plots_the_busiest_experts_load_over_the_mean(self):
        even = self.summary("even.json", [[8, 8, 8, 8]] * 3)
        skew = self.summary("skew.json", [[20, 4, 4, 4], [16, 8, 4, 4], [8, 8, 8, 8]])
        out = self.tmp / "b.svg"
        r = run([sys.executable, TOOLS / "moe_svg.py", "balance", f"{even}:even", f"{skew}:skew",
                 "--smooth", "1", "-o", out])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("even: max/mean over the last quarter of the steps 1.000", r.stdout)
        # The last step alone (a quarter of 3 steps rounds to none: the whole run): 2.5, 2.0, 1.0.
        self.assertIn("skew: max/mean over the last quarter of the steps 1.833", r.stdout)
        self.assertIn("<title>stage 10: the busiest expert", out.read_text())

    def test_balance_refuses_another_stage_and_a_missing_layer(self):
        other = self.tmp / "o.json"
        other.write_text(json.dumps({"steps": []}))
        out = self.tmp / "b.svg"
        r = run([sys.executable, TOOLS / "moe_svg.py", "balance", other, "-o", out])
        self.assertEqual(r.returncode, 2)
        self.assertIn("not a 10_expert_parallel --json", r.stderr)
        one = self.summary("one.json", [[8, 8, 8, 8]])
        r = run([sys.executable, TOOLS / "moe_svg.py", "balance", one, "--layer", "1", "-o", out])
        self.assertEqual(r.returncode, 2)
        self.assertIn("has 1 MoE layers, not layer 1", r.stderr)
        self.assertFalse(out.exists())
        # No step, and a step whose counts are all zero: one line each, nothing written.
        for name, counts, words in (("none.json", [], "holds no step"),
                                    ("zero.json", [[0, 0, 0, 0]], "at least one assignment")):
            r = run([sys.executable, TOOLS / "moe_svg.py", "balance", self.summary(name, counts),
                     "-o", out])
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(words, r.stderr)
            self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
            self.assertFalse(out.exists())

    def test_dispatch_draws_every_row_each_expert_receives(self):
        out = self.tmp / "d.svg"
        r = run([sys.executable, TOOLS / "moe_svg.py", "dispatch", "-o", out])
        self.assertEqual(r.returncode, 0, r.stderr)
        text = out.read_text()
        # Six tokens, two experts each: twelve rows sent and twelve received.
        self.assertEqual(text.count(" for e"), 12)
        self.assertEqual(text.count("(from "), 12)


class GpuReport(unittest.TestCase):
    """tools/gpu_report.py on a run written here: two parts, one with a report, one logs only."""

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory(dir=TOOLS.parent / "docs")
        self.run_dir = pathlib.Path(self.dir.name) / "run"
        logs = self.run_dir / "logs"
        (logs / "unit" / "logs").mkdir(parents=True)
        (logs / "bench" / "logs").mkdir(parents=True)
        (logs / "report-unit.md").write_text(
            "# GPU validation\n\n- date: 2030-01-02 03:04 UTC\n"
            "- device: Test GPU, 1.2, Default (name, driver, compute mode)\n- commit: abc1234\n"
            "- build: b; parts: unit\n\n| # | step | result | seconds | command | log |\n"
            "|---|---|---|---|---|---|\n| 1 | ok_step | pass | 3 | `x` | 01-ok_step.log |\n"
            "| 2 | bad_step | FAIL (exit 1) | 7 | `y` | 02-bad_step.log |\n\n1 passed, 1 failed\n")
        (logs / "bench" / "logs" / "01-bench_x.log").write_text(
            "terminate called after throwing an instance of 'E'\n  what():  it broke\n")
        self.page = pathlib.Path(self.dir.name) / "page.md"
        self.page.write_text("intro\n<!-- tpx-gpu:begin steps -->\nold\n"
                             "<!-- tpx-gpu:end steps -->\nafter\n")

    def tearDown(self):
        self.dir.cleanup()

    def tool(self, *args):
        return run([sys.executable, TOOLS / "gpu_report.py", self.run_dir, "--page", self.page,
                    *args])

    def test_writes_every_step_with_its_result_and_checks_the_page(self):
        self.assertEqual(self.tool("--check").returncode, 1)  # the page holds "old"
        self.assertEqual(self.tool().returncode, 0)
        text = self.page.read_text()
        self.assertTrue(text.startswith("intro\n") and text.endswith("after\n"))
        self.assertIn("- device: Test GPU, 1.2, Default (name, driver, compute mode)\n", text)
        self.assertIn("- commit (as the reports name it): abc1234", text)
        self.assertIn("- steps: 3, of which 1 passed or ran and 2 failed", text)
        self.assertIn("| unit | 2 | bad_step | FAIL (exit 1) | 7 |", text)
        self.assertIn("| bench | 1 | bench_x | aborted: `it broke` | — |", text)
        self.assertLess(text.index("| unit |"), text.index("| bench |"))  # the script's order
        self.assertEqual(self.tool("--check").returncode, 0)

    def test_a_report_without_its_header_is_one_line_and_exit_2(self):
        report = self.run_dir / "logs" / "report-unit.md"
        report.write_text(report.read_text().replace("- commit: abc1234\n", ""))
        r = self.tool()
        self.assertEqual(r.returncode, 2)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        self.assertIn("no '- commit:' line", r.stderr)



class SplitTable(unittest.TestCase):
    """gpu_logs.split_table: the fused kernels' forward and backward beside SDPA's."""

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        d = pathlib.Path(self.dir.name)
        self.attention, self.sdpa = d / "03-bench_attention.log", d / "04-sdpa_bench.log"
        self.attention.write_text(
            "attention/cuda/bf16/fused/S:2048/real_time   1.25 ms   1.25 ms   562 TFLOP/s=96.5\n"
            "attention/cuda/bf16/fused-fwd/S:2048/real_time   0.500 ms   0.500 ms   10 "
            "TFLOP/s=100 S=2048 B=1 NH=32 D=128\n"
            "attention/cuda/bf16/fused-bwd/S:2048/real_time   2.00 ms   2.00 ms   10 "
            "TFLOP/s=62.5 S=2048 B=1 NH=32 D=128\n")
        self.sdpa.write_text(
            "sdpa_bench: GPU, torch 2.0, bf16\n"
            "attention/cuda/bf16/sdpa-fwd/S:2048  B=1 NH=32 D=128  0.125 ms  TFLOP/s=400.0\n")

    def tearDown(self):
        self.dir.cleanup()

    def test_each_pass_beside_sdpas_with_the_ratio_of_their_tflops(self):
        sys.path.insert(0, str(TOOLS))
        import gpu_logs
        lines = gpu_logs.split_table([self.attention], [self.sdpa])
        self.assertIn("| 2048 | forward | 0.5 ms, 100.0 | 0.125 ms, 400.0 | 0.250 |", lines)
        self.assertIn("| 2048 | backward | 2 ms, 62.5 | — | — |", lines)
        self.assertLess(lines.index("| 2048 | forward | 0.5 ms, 100.0 | 0.125 ms, 400.0 | 0.250 |"),
                        lines.index("| 2048 | backward | 2 ms, 62.5 | — | — |"))
        self.sdpa.write_text("sdpa_bench: GPU, torch 2.0, bf16\n")
        self.attention.write_text(
            "attention/cuda/bf16/fused/S:2048/real_time   1.25 ms   1.25 ms   562 TFLOP/s=96.5\n")
        self.assertEqual(gpu_logs.split_table([self.attention], [self.sdpa]), [])

if __name__ == "__main__":
    unittest.main()
