#!/usr/bin/env python3
"""Unit tests of the benchmark driver's arithmetic (tools/bench.py) on made-up inputs whose
expected values are worked out by hand in the comments. Run by ctest (bench.driver.arithmetic).

    python3 tools/test_bench.py
"""
import contextlib
import importlib.util
import io
import json
import pathlib
import re
import shutil
import sys
import tempfile
import unittest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench  # noqa: E402
import gpu_logs  # noqa: E402


def summary(stage, n, ms, exposed, bus, peaks, flops=4e9, saved=3 * 1024 * 1024):
    """A --json summary with the fields the driver reads."""
    steps = [{"ms": m, "exposed_comm_ms": e, "comm_bus_bytes": b, "peak_bytes": p}
             for m, e, b, p in zip(ms, exposed, bus, peaks)]
    return {"stage": stage, "world_size": n, "config": {"device": "cpu", "dtype": "fp32"},
            "flops_per_step_per_rank": flops, "saved_activation_bytes": saved, "steps": steps}


class Arithmetic(unittest.TestCase):
    def test_steady_mean_leaves_out_the_warm_up_step(self):
        # (10 + 20 + 30) / 3 = 20; step 0's 100 is not counted.
        self.assertEqual(bench.steady_mean([{"ms": 100}, {"ms": 10}, {"ms": 20}, {"ms": 30}], "ms"),
                         20.0)
        self.assertEqual(bench.steady_mean([{"ms": 7}], "ms"), 7.0)  # only step 0: itself
        with self.assertRaises(bench.BenchError):
            bench.steady_mean([], "ms")

    def test_median_and_spread(self):
        self.assertEqual(bench.median_spread([3.0, 1.0, 2.0]), (2.0, 1.0, 3.0))
        # Even count: the mean of the middle two, (2 + 3) / 2 = 2.5; spread 1 … 10.
        self.assertEqual(bench.median_spread([10.0, 1.0, 3.0, 2.0]), (2.5, 1.0, 10.0))
        self.assertEqual(bench.median_spread([5.0]), (5.0, 5.0, 5.0))

    def test_tflops_and_mfu(self):
        # 2e9 FLOPs in 10 ms: 2e11 FLOP/s = 0.2 TFLOP/s; against a 0.5 TFLOP/s peak: 40 %.
        tf = bench.tflops_per_rank(2e9, 10.0)
        self.assertAlmostEqual(tf, 0.2, places=12)
        self.assertAlmostEqual(bench.mfu(tf, 0.5), 0.4, places=12)
        self.assertIsNone(bench.mfu(tf, None))  # no measured peak: no MFU, never an assumed one

    def test_bus_bandwidth(self):
        # 3e6 bus bytes per step in 2 ms: 1.5e9 B/s = 1.5 GB/s.
        self.assertAlmostEqual(bench.bus_gbps(3e6, 2.0), 1.5, places=12)
        self.assertEqual(bench.bus_gbps(0, 2.0), 0.0)

    def test_speedup_against_stage_03(self):
        self.assertAlmostEqual(bench.speedup(30.0, 20.0), 1.5)  # 03 takes 30 ms, the stage 20
        self.assertAlmostEqual(bench.speedup(30.0, 60.0), 0.5)
        self.assertIsNone(bench.speedup(None, 20.0))

    def test_mesh_stage_labels_name_their_own_dimension(self):
        self.assertEqual(bench.stage_label("07_fsdp_tp", 2), "07_fsdp_tp D2")
        self.assertEqual(bench.stage_label("08_context_parallel", 4), "08_context_parallel C4")
        self.assertEqual(bench.stage_label("03_sequence_parallel", 2), "03_sequence_parallel")
        self.assertEqual(bench.split_label("08_context_parallel C2"),
                         ("08_context_parallel", "--cp", "2"))
        self.assertEqual(bench.split_label("07_fsdp_tp D1"), ("07_fsdp_tp", "--dp", "1"))
        self.assertEqual(bench.split_label("06_fp8"), ("06_fp8", None, None))

    def test_divides(self):
        c = {"hidden": 256, "heads": 8, "ffn": 1024, "seq": 128}
        self.assertTrue(bench.divides(c, 4))
        self.assertFalse(bench.divides(c, 3))
        self.assertFalse(bench.divides({**c, "heads": 6}, 4))  # 6 heads do not split 4 ways

    def test_summarise_point(self):
        # Three runs; their steady means (steps 1, 2) of ms: (10+14)/2 = 12, (20+22)/2 = 21,
        # (15+17)/2 = 16 -> median 16, spread 12–21. exposed: 1, 2, 3 -> median 2.
        # bus bytes: 4e6 each -> 4e6 B / 16 ms = 0.25 GB/s. TFLOP/s: 4e9 / 16 ms = 0.25.
        # peak bytes: max over steps 2 MiB, 3 MiB, 4 MiB -> median 3 MiB.
        mib = 1024 * 1024
        runs = [summary("04_overlap_ring", 2, [99, 10, 14], [9, 1, 1], [4e6] * 3,
                        [mib, 2 * mib, mib]),
                summary("04_overlap_ring", 2, [99, 20, 22], [9, 2, 2], [4e6] * 3,
                        [3 * mib, mib, mib]),
                summary("04_overlap_ring", 2, [99, 15, 17], [9, 3, 3], [4e6] * 3,
                        [mib, mib, 4 * mib])]
        r = bench.summarise_point(runs)
        self.assertEqual((r["stage"], r["n"], r["device"], r["dtype"]),
                         ("04_overlap_ring", 2, "cpu", "fp32"))
        self.assertEqual((r["step_ms"], r["step_ms_min"], r["step_ms_max"]), (16.0, 12.0, 21.0))
        self.assertEqual(r["repeats"], 3)
        self.assertEqual(r["exposed_ms"], 2.0)
        self.assertAlmostEqual(r["bus_gbps"], 0.25, places=12)
        self.assertAlmostEqual(r["tflops"], 0.25, places=12)
        self.assertEqual(r["peak_mib"], 3.0)
        self.assertEqual(r["saved_mib"], 3.0)

    def test_derived_columns_pair_each_stage_with_03_at_its_config_and_n(self):
        rows = [{"config": "a", "stage": "03_sequence_parallel", "n": 2, "step_ms": 40.0,
                 "tflops": 0.1},
                {"config": "a", "stage": "04_overlap_ring", "n": 2, "step_ms": 32.0,
                 "tflops": 0.125},
                {"config": "a", "stage": "03_sequence_parallel", "n": 1, "step_ms": 10.0,
                 "tflops": 0.4},
                {"config": "a", "stage": "01_baseline", "n": 1, "step_ms": 20.0, "tflops": 0.2},
                {"config": "b", "stage": "04_overlap_ring", "n": 2, "step_ms": 5.0,
                 "tflops": 0.8}]
        bench.add_derived(rows, 0.5)
        self.assertEqual([r["speedup"] for r in rows], [1.0, 1.25, 1.0, 0.5, None])  # 40/32, 10/20
        self.assertEqual([r["mfu"] for r in rows], [0.2, 0.25, 0.8, 0.4, 1.6])  # tflops / 0.5
        self.assertEqual({r["peak_tflops"] for r in rows}, {0.5})


class Sections(unittest.TestCase):
    DOC = ("# intro\n\n<!-- tpx-bench:begin cpu -->\nold cpu\n<!-- tpx-bench:end cpu -->\n\n"
           "<!-- tpx-bench:begin cuda -->\nthe cuda numbers\n<!-- tpx-bench:end cuda -->\n")

    def test_a_run_replaces_its_own_section_only(self):
        text = bench.replace_section(self.DOC, "cpu", "new cpu")
        self.assertIn("<!-- tpx-bench:begin cpu -->\nnew cpu\n<!-- tpx-bench:end cpu -->", text)
        self.assertNotIn("old cpu", text)
        self.assertIn("<!-- tpx-bench:begin cuda -->\nthe cuda numbers\n", text)
        self.assertEqual(bench.replace_section(text, "cpu", "new cpu"), text)  # idempotent

    def test_a_new_section_goes_in_its_place(self):
        doc = "# intro\n\n<!-- tpx-bench:begin projection -->\np\n<!-- tpx-bench:end projection -->\n"
        text = bench.replace_section(doc, "cuda", "g")
        self.assertLess(text.index("begin cuda"), text.index("begin projection"))
        self.assertIn("# intro", text)

    def test_intro_is_replaced_and_sections_kept(self):
        text = bench.replace_intro(self.DOC, "# Benchmarks\n\nnew intro")
        self.assertTrue(text.startswith("# Benchmarks\n\nnew intro\n\n<!-- tpx-bench:begin cpu"))
        self.assertIn("the cuda numbers", text)

    def test_a_broken_section_is_an_error(self):
        with self.assertRaises(bench.BenchError):
            bench.replace_section("<!-- tpx-bench:begin cpu -->\nx\n", "cpu", "y")


class Completeness(unittest.TestCase):
    def row(self, **changes):
        r = {f: "1" for f in bench.CSV_FIELDS}
        r.update(config="default", stage="03_sequence_parallel", n="2")
        r.update(changes)
        return r

    def test_a_complete_table_passes(self):
        self.assertEqual(bench.missing_cells([self.row()], [("default", "03_sequence_parallel", 2)],
                                             True, True), [])

    def test_missing_points_and_cells_are_reported(self):
        problems = bench.missing_cells([self.row(mfu="", step_ms="nan")],
                                       [("default", "03_sequence_parallel", 2),
                                        ("default", "04_overlap_ring", 2)], True, True)
        self.assertEqual(len(problems), 3, problems)
        self.assertTrue(any("04_overlap_ring" in p for p in problems))
        self.assertTrue(any("no mfu" in p for p in problems))
        self.assertTrue(any("step_ms is nan" in p for p in problems))

    def test_mfu_may_be_empty_only_without_a_measured_peak(self):
        self.assertEqual(bench.missing_cells([self.row(mfu="")], [], False, True), [])
        self.assertEqual(bench.missing_cells([self.row(speedup="")], [], True, False), [])
        self.assertEqual(len(bench.missing_cells([self.row(speedup="")], [], True, True)), 1)


class Parsing(unittest.TestCase):
    def test_peak_is_the_largest_gemm_of_the_peak_dtype(self):
        gemm = [{"dtype": "bf16", "gemm": "wq/fwd", "m": 8, "n": 8, "k": 8, "tflops": 900.0},
                {"dtype": "bf16", "gemm": "w_gate/fwd", "m": 8, "n": 32, "k": 8, "tflops": 700.0},
                {"dtype": "bf16", "gemm": "w_down/dx", "m": 8, "n": 8, "k": 32, "tflops": 750.0},
                {"dtype": "fp8", "gemm": "w_gate/fwd", "m": 64, "n": 64, "k": 64,
                 "tflops": 1500.0}]
        # cuda: bf16 only; the two largest (2048 MACs) tie on size, the faster one is the peak.
        self.assertEqual(bench.measured_peak(gemm, "cuda")["tflops"], 750.0)
        self.assertIsNone(bench.measured_peak(gemm, "cpu"))  # no fp32 rows: no peak
        self.assertIsNone(bench.measured_peak(None, "cpu"))

    def test_benchmark_rows(self):
        j = {"benchmarks": [
            {"name": "gemm/cpu/fp32/wq/fwd/real_time", "run_type": "iteration", "real_time": 2.0,
             "time_unit": "ms", "TFLOP/s": 0.1, "label": "m=256 n=128 k=64"},
            {"name": "gemm_chunked/cpu/fp32/w_gate/N:4/manual_time", "real_time": 900.0,
             "time_unit": "us", "efficiency": 0.9, "TFLOP/s": 0.09},
            {"name": "gemm/cpu/fp32/wq/fwd/real_time_mean", "run_type": "aggregate",
             "real_time": 1.0, "time_unit": "ms"}]}
        gemm, chunked = bench.parse_gemm(j, "cpu")
        self.assertEqual(gemm, [{"dtype": "fp32", "gemm": "wq/fwd", "m": 256, "n": 128, "k": 64,
                                 "us": 2000.0, "tflops": 0.1}])
        self.assertEqual(chunked, [{"dtype": "fp32", "gemm": "w_gate", "n": 4, "efficiency": 0.9,
                                    "tflops": 0.09}])

    def test_collective_rows_sorted_by_size(self):
        def row(size, wrong=0):
            return {"name": f"collective/all_gather/cpu/{size}/manual_time", "real_time": 1.0,
                    "time_unit": "us", "time_us": 3.0, "bytes": size, "count": size // 4,
                    "algbw_GBps": 1.0, "busbw_GBps": 0.5, "wrong": wrong, "ranks": 2}
        ops = bench.parse_collectives({"benchmarks": [row(4096, 3), row(1024)]})
        self.assertEqual([r["bytes"] for r in ops["all_gather"]], [1024, 4096])
        self.assertEqual(ops["all_gather"][1]["wrong"], 3)
        self.assertEqual(ops["all_gather"][0]["us"], 3.0)
        self.assertEqual(bench.size_label(65536), "64K")
        self.assertEqual(bench.size_label(3 << 20), "3M")
        self.assertEqual(bench.size_label(1000), "1000")



class Oversubscribed(unittest.TestCase):
    def test_speedup_hidden_where_ranks_outnumber_cores(self):
        cores = bench.os.cpu_count() or 1
        fmt = dict((k, f) for k, _, f in bench.COLUMNS)["speedup"]
        over = {"device": "cpu", "n": cores + 1, "speedup": 1.5}
        fits = {"device": "cpu", "n": 1, "speedup": 1.5}
        gpu = {"device": "cuda", "n": cores + 1, "speedup": 1.5}
        self.assertEqual(bench.cell(over, "speedup", fmt), "— (N > cores)")
        self.assertEqual(bench.cell(fits, "speedup", fmt), "1.50×")
        self.assertEqual(bench.cell(gpu, "speedup", fmt), "1.50×")  # GPUs are not shared
        self.assertEqual(bench.cell(over, "step_ms", bench._f(2)), "—")  # other cells as before


class Selection(unittest.TestCase):
    """scripts/bench.sh --stages / --ranks / --model / --config, as the driver reads them."""

    def test_stages_by_number_or_name_in_the_sweeps_order(self):
        self.assertEqual(bench.stage_list("05,4"), ["04_overlap_ring", "05_copy_engine_async_tp"])
        self.assertEqual(bench.stage_list("07_fsdp_tp"), ["07_fsdp_tp"])
        self.assertEqual(bench.stage_list("9"), ["09_pipeline_parallel"])
        for bad in ("10", "overlap", ","):
            with self.assertRaises(Exception, msg=bad):
                bench.stage_list(bad)

    def test_ranks_are_distinct_positive_and_sorted(self):
        self.assertEqual(bench.rank_list("4,2,2"), [2, 4])
        for bad in ("0", "2,x", ""):
            with self.assertRaises(Exception, msg=bad):
                bench.rank_list(bad)

    def test_a_preset_or_a_file_is_the_one_config_and_is_forwarded(self):
        (model,) = bench.configs_for("cpu", False, model="llama3-8b")
        self.assertEqual(bench.config_flags(model), ["--model", "llama3-8b"])
        (cfg,) = bench.configs_for("cpu", False, config_file="/x/my-model.toml")
        self.assertEqual(cfg["name"], "my-model")
        self.assertEqual(bench.config_flags(cfg), ["--config", "/x/my-model.toml"])
        self.assertEqual(len(bench.configs_for("cpu", False)), 2)  # no selection: both configs

    def test_the_page_says_what_ran(self):
        text = bench.ran_text(["04_overlap_ring", "07_fsdp_tp"], [2, 4],
                              bench.configs_for("cpu", False, model="tiny"), 1, 3, False)
        self.assertIn("`04_overlap_ring` and `07_fsdp_tp` over N = 2, 4", text)
        self.assertIn("D 1 × TP 2, D 2 × TP 1, D 2 × TP 2", text)  # the meshes at N = 2 and 4
        self.assertIn("config `tiny`; 1 repeat of 3 steps", text)
        self.assertNotIn("06_fp8", text)
        text = bench.ran_text(["08_context_parallel"], [2], bench.configs_for("cpu", True), 1, 3,
                              False, {"08_context_parallel": [(2, 1), (2, 2)]})
        self.assertIn("`08_context_parallel` on the meshes C 1 × TP 2, C 2 × TP 1", text)

    def test_only_text_writes_the_line_of_what_ran_once(self):
        import csv, tempfile
        with tempfile.TemporaryDirectory() as tmp:
            out = pathlib.Path(tmp)
            (out / "benchmarks").mkdir()
            with open(out / "benchmarks" / "cpu.csv", "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=["config", "stage", "n", "repeats", "steps"])
                w.writeheader()
                for stage, n in [("02_megatron_tp", 1), ("02_megatron_tp", 2), ("07_fsdp_tp D2", 4)]:
                    w.writerow({"config": "default", "stage": stage, "n": n, "repeats": 3,
                                "steps": 8})
            (out / "benchmarks.md").write_text(
                "# old intro\n\n<!-- tpx-bench:begin cpu -->\n## CPU\n\nLoad.\n\n"
                "Each point: ...\n<!-- tpx-bench:end cpu -->\n")
            bench.drive_text(out)
            once = (out / "benchmarks.md").read_text()
            bench.drive_text(out)
            self.assertEqual((out / "benchmarks.md").read_text(), once)  # idempotent
            self.assertNotIn("old intro", once)
            self.assertIn("Load.\n\nRan `02_megatron_tp` and `07_fsdp_tp` over N = 1, 2, 4 "
                          "(`07_fsdp_tp` on the meshes D 2 × TP 2); config `default`; 3 repeats "
                          "of 8 steps per point.\n\nEach point: ...", once)


def trace(ranks):
    """A --trace file's JSON: per rank {"forward": [start µs of each step], "spans": [(name, lane
    name, ts µs, dur µs)]}; the lanes' tids are given by thread_name records, as the stages write."""
    tids = {"compute": 0, "comm": 1, "phases": 3, "cp comm": 5}
    events = []
    for rank, r in ranks.items():
        events += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                    "args": {"name": lane}} for lane, tid in tids.items()]
        events += [{"name": "forward", "ph": "X", "pid": rank, "tid": tids["phases"], "ts": ts,
                    "dur": 10} for ts in r["forward"]]
        events += [{"name": name, "ph": "X", "pid": rank, "tid": tids[lane], "ts": ts, "dur": dur}
                   for name, lane, ts, dur in r["spans"]]
    return {"traceEvents": events}


# Rank 0: step 0 (from 0 µs) 0.5 ms of attention (warm-up), step 1 (from 1000 µs) 200 + 300 µs
# = 0.5 ms, step 2 (from 2000 µs) 100 + 200 µs = 0.3 ms; a ring step nested in a span, attention
# on another lane and another op are not counted. Rank 1: steps 1 and 2 take 0.7 and 0.9 ms.
# Per rank, steps 1 … : (0.5 + 0.3) / 2 = 0.4 and (0.7 + 0.9) / 2 = 0.8; over the ranks 0.6 ms.
# The ring steps alone: rank 0 has 50 µs in step 1 and 0 in step 2 (0.025 ms per step), rank 1
# 0 and 30 + 70 µs (0.05 ms); over the ranks 0.0375 ms.
TWO_RANKS = {
    0: {"forward": [0, 1000, 2000],
        "spans": [("attention fwd", "compute", 100, 500),
                  ("attention fwd", "compute", 1100, 200),
                  ("attention fwd ring step 1/2 (K/V of cp rank 0)", "compute", 1110, 50),
                  ("cp K/V ring fwd 1 hop 1/1", "cp comm", 1120, 150),
                  ("attention fwd", "comm", 1150, 400),
                  ("rope fwd", "compute", 1400, 90),
                  ("attention bwd", "compute", 1500, 300),
                  ("attention fwd", "compute", 2100, 100),
                  ("attention bwd", "compute", 2500, 200)]},
    1: {"forward": [5, 1005, 2005],
        "spans": [("attention fwd", "compute", 105, 800),
                  ("attention bwd", "compute", 1600, 700),
                  ("attention fwd", "compute", 2200, 400),
                  ("attention bwd", "compute", 2700, 500),
                  ("attention bwd ring step 1/2 (K/V of cp rank 1)", "compute", 2710, 30),
                  ("attention bwd ring step 2/2 (K/V of cp rank 0)", "compute", 2750, 70)]}}


class ContextParallel(unittest.TestCase):
    """Stage 08's subsection: the points it runs, attention time from the traces, the plot's
    lines, and the check that reads its outputs back."""

    def test_the_sweep_has_the_meshes_at_two_lengths_and_attention_at_three(self):
        table, attention = bench.cp_plan([1, 2, 4], False)
        for seq in (128, 512):  # the default S and a longer one
            for label, n in [("08_context_parallel C2", 2), ("08_context_parallel C1", 2),
                             ("08_context_parallel C2", 4)]:  # C × T = 2 × 1, 1 × 2, 2 × 2
                self.assertIn((seq, label, n), table)
            for n in (1, 2, 4):  # the speed-up's reference at the same S and N
                self.assertIn((seq, "03_sequence_parallel", n), table)
        for c in (1, 2, 4):
            seqs = [s for s, cc in attention if cc == c]
            self.assertGreaterEqual(len(seqs), 3, c)
            self.assertTrue(all(s % (2 * c) == 0 for s in seqs), seqs)
        self.assertEqual(bench.cp_plan([1, 2], True),  # quick: N <= 2, the default S only
                         ([(128, "03_sequence_parallel", 1), (128, "03_sequence_parallel", 2),
                           (128, "08_context_parallel C2", 2), (128, "08_context_parallel C1", 2)],
                          [(32, 1), (32, 2), (64, 1), (64, 2), (128, 1), (128, 2)]))
        # cuda: the stage table only (--cp > 1 is the cpu's; spans would time the host).
        self.assertEqual(bench.cp_plan([1, 2, 4], False, "cuda"), (table, []))

    def test_each_point_runs_with_its_mesh(self):
        import types
        a = types.SimpleNamespace(build="/b", out="/o", work="/w", device="cpu", mpirun="mpirun",
                                  quick=False, ranks=None, repeats=1, model=None, config=None)
        d = bench.Driver(a)
        cmd = d.stage_cmd("08_context_parallel C1", 2, d.cp_config(512), "x.json")
        self.assertEqual(cmd[:3], ["mpirun", "-np", "2"])
        self.assertEqual(cmd[cmd.index("--seq") + 1], "512")
        self.assertEqual(cmd[cmd.index("--cp") + 1], "1")  # C 1 × T 2
        cmd = d.stage_cmd("03_sequence_parallel", 4, d.cp_config(128), "x.json")
        self.assertNotIn("--cp", cmd)
        self.assertEqual(d.cp_config(512)["name"], "S512")

    def test_attention_time_from_the_trace(self):
        per_step = bench.attention_ms_per_step(trace(TWO_RANKS))
        self.assertEqual(sorted(per_step), [0, 1])
        for got, want in zip(per_step[0], [0.5, 0.5, 0.3]):
            self.assertAlmostEqual(got, want, places=12)
        for got, want in zip(per_step[1], [0.8, 0.7, 0.9]):
            self.assertAlmostEqual(got, want, places=12)
        self.assertAlmostEqual(bench.attention_ms(trace(TWO_RANKS)), 0.6, places=12)
        self.assertAlmostEqual(bench.attention_ms(trace(TWO_RANKS), blocks=True), 0.0375,
                               places=12)
        with self.assertRaises(bench.BenchError):  # no steps to put the spans in
            bench.attention_ms(trace({0: {"forward": [],
                                          "spans": [("attention fwd", "compute", 0, 5)]}}))
        with self.assertRaises(bench.BenchError):  # no spans at all
            bench.attention_ms(trace({0: {"forward": [], "spans": []}}))

    def test_a_point_of_the_attention_sweep(self):
        # Two runs: attention 0.6 ms (above) and 0.3 ms (every span halved) -> median 0.45,
        # spread 0.3–0.6; step ms (after step 0) 3 and 6 -> median 4.5; share 0.45 / 4.5 = 10 %;
        # ring steps 0.0375 and 0.01875 -> 0.028125; rank 0's cp_attention_ms 0.2 and 0.4 -> 0.3
        # (C = 2); neither at C = 1.
        half = {r: {"forward": v["forward"],
                    "spans": [(n, lane, ts, dur / 2) for n, lane, ts, dur in v["spans"]]}
                for r, v in TWO_RANKS.items()}
        runs = [({"steps": [{"ms": 99, "cp_attention_ms": 9}, {"ms": 3, "cp_attention_ms": 0.2}]},
                 trace(TWO_RANKS)),
                ({"steps": [{"ms": 99, "cp_attention_ms": 9}, {"ms": 6, "cp_attention_ms": 0.4}]},
                 trace(half))]
        r = bench.summarise_attention(256, 2, runs)
        self.assertEqual((r["seq"], r["c"], r["n"], r["t"], r["repeats"]), (256, 2, 2, 1, 2))
        self.assertAlmostEqual(r["attention_ms"], 0.45, places=12)
        self.assertAlmostEqual(r["attention_ms_min"], 0.3, places=12)
        self.assertAlmostEqual(r["attention_ms_max"], 0.6, places=12)
        self.assertAlmostEqual(r["step_ms"], 4.5, places=12)
        self.assertAlmostEqual(r["share"], 0.1, places=12)
        self.assertAlmostEqual(r["blocks_ms"], 0.028125, places=12)
        self.assertAlmostEqual(r["cp_attention_ms_rank0"], 0.3, places=12)
        one = bench.summarise_attention(256, 1, runs)
        self.assertIsNone(one["blocks_ms"])
        self.assertIsNone(one["cp_attention_ms_rank0"])

    ROWS = [{"seq": 256, "c": 2, "n": 2, "t": 1, "repeats": 1, "steps": 8, "attention_ms": 3.0,
             "attention_ms_min": 2.0, "attention_ms_max": 5.0, "blocks_ms": 1.5,
             "cp_attention_ms_rank0": 1.6, "step_ms": 30.0,
             "share": 0.1},
            {"seq": 128, "c": 2, "n": 2, "t": 1, "repeats": 1, "steps": 8, "attention_ms": 1.0,
             "attention_ms_min": 1.0, "attention_ms_max": 1.5, "blocks_ms": 0.5,
             "cp_attention_ms_rank0": 0.6, "step_ms": 20.0,
             "share": 0.05},
            {"seq": 128, "c": 1, "n": 1, "t": 1, "repeats": 1, "steps": 8, "attention_ms": 2.0,
             "attention_ms_min": 1.5, "attention_ms_max": 2.5, "blocks_ms": None,
             "cp_attention_ms_rank0": None, "step_ms": 40.0,
             "share": 0.05}]

    def test_the_plots_lines_are_the_rows(self):
        s = bench.attention_series(self.ROWS)
        self.assertEqual(sorted(s), [1, 2])
        self.assertEqual(s[2], {"seq": [128, 256], "ms": [1.0, 3.0],
                                "err": [[0.0, 1.0], [0.5, 2.0]], "blocks": [0.5, 1.5]})
        self.assertEqual(s[1], {"seq": [128], "ms": [2.0], "err": [[0.5], [0.5]],
                                "blocks": [None]})

    def test_the_outputs_are_read_back(self):
        import csv, tempfile
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            self.skipTest("no matplotlib")
        table = [{f: 1.0 for f in bench.CSV_FIELDS} | {"config": "S128", "n": 2, "c": 2, "t": 1,
                                                       "stage": "08_context_parallel C2"}]
        with tempfile.TemporaryDirectory() as tmp:
            out = pathlib.Path(tmp)
            bench.write_csv(table, out / "benchmarks" / "cpu_cp.csv", bench.CP_CSV_FIELDS)
            bench.write_csv(self.ROWS, out / "benchmarks" / "cpu_cp_attention.csv",
                            bench.ATTENTION_FIELDS)
            svg = bench.plot_cp_attention(self.ROWS, "cpu", out / "figures").read_text()
            self.assertIn("C = 1 (N = 1, T = 1)", svg)  # a line per C, dashed blocks at C > 1
            self.assertIn("C = 2: its ring steps alone", svg)
            self.assertNotIn("C = 1: its ring steps", svg)
            block = ["<!-- tpx-bench:begin cpu-cp -->", "### Stage 08",
                     "| 08_context_parallel C2 | 2 × 1 | 2 | cpu |",
                     "| 256 | 2 | 2 | 3.00 |", "| 128 | 2 | 2 | 1.00 |", "| 128 | 1 | 1 | 2.00 |",
                     "<!-- tpx-bench:end cpu-cp -->"]
            doc = ("# B\n\n<!-- tpx-bench:begin cpu -->\n## CPU\n\ntables\n\n"
                   "### Micro-benchmarks (cpu)\n\nx\n<!-- tpx-bench:end cpu -->\n")
            text = bench.replace_subsection(doc, "cpu", "cp", block)
            self.assertLess(text.index("tables"), text.index("begin cpu-cp"))
            self.assertLess(text.index("end cpu-cp"), text.index("### Micro-benchmarks"))
            self.assertEqual(bench.replace_subsection(text, "cpu", "cp", block), text)  # in place
            (out / "benchmarks.md").write_text(text)
            expected = [("S128", "08_context_parallel C2", 2)]
            points = [(256, 2), (128, 2), (128, 1)]
            self.assertEqual(bench.verify_cp(out, "cpu", expected, points, True), [])
            # A point that did not run, a table row the page lacks, an empty ring-blocks cell:
            problems = bench.verify_cp(out, "cpu", expected + [("S512", "08_context_parallel C2",
                                                                4)], points + [(512, 4)], True)
            self.assertEqual(len(problems), 2, problems)
            (out / "benchmarks.md").write_text(text.replace("| 256 | 2 | 2 |", "| 256 | 2 | 4 |"))
            self.assertEqual(len(bench.verify_cp(out, "cpu", expected, points, True)), 1)
            rows = [dict(r, blocks_ms=None) if r["c"] == 2 else r for r in self.ROWS]
            bench.write_csv(rows, out / "benchmarks" / "cpu_cp_attention.csv",
                            bench.ATTENTION_FIELDS)
            (out / "benchmarks.md").write_text(text)
            problems = bench.verify_cp(out, "cpu", expected, points, True)
            self.assertEqual(len(problems), 2, problems)  # blocks_ms at C = 2, both S
            self.assertTrue(all("blocks_ms" in p for p in problems))

    def test_stages_08_and_09_are_in_their_subsections_only(self):
        main, wanted = bench.parts(bench.STAGES, None, False)
        self.assertNotIn("08_context_parallel", main)
        self.assertNotIn("09_pipeline_parallel", main)
        self.assertIn("07_fsdp_tp", main)
        self.assertEqual(wanted, ["cp", "pp"])  # a full run has both
        self.assertEqual(bench.parts(["08_context_parallel"], None, False), ([], ["cp"]))
        self.assertEqual(bench.parts(["04_overlap_ring", "09_pipeline_parallel"], None, False),
                         (["04_overlap_ring"], ["pp"]))
        self.assertEqual(bench.parts(bench.STAGES, "cp", False), ([], ["cp"]))
        self.assertEqual(bench.parts(bench.STAGES, "pp", False), ([], ["pp"]))
        self.assertEqual(bench.parts(bench.STAGES, None, True)[1], [])  # --model: own sizes only
        for alone in (["08_context_parallel"], ["09_pipeline_parallel"]):
            with self.assertRaises(bench.BenchError):
                bench.parts(alone, None, True)


def pp_summary(n, bubble, formula, ms, pp_bytes, live):
    """A stage 09 --json summary with the fields the pp sweep reads."""
    return {"stage": "09_pipeline_parallel", "world_size": n,
            "steps": [{"ms": m, "pp_bus_bytes": b} for m, b in zip(ms, pp_bytes)],
            "pipeline": {"bubble_measured": bubble, "bubble_formula": formula,
                         "live_peak": live}}


class PipelineSubsection(unittest.TestCase):
    def test_the_sweep_has_every_schedule_at_p_2_and_4_over_m(self):
        points = bench.pp_plan([1, 2, 4], False)
        z = bench.PP_SIZES[False]
        for name, v in [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)]:
            for p in (2, 4):
                ms = [m for s, pp, vv, m in points if s == name and pp == p]
                self.assertTrue(all(vv == v for s, pp, vv, _ in points if s == name), name)
                if v == 1:
                    self.assertEqual(ms, [1, 2, 4, 8], (name, p))
                else:  # interleaved: P divides M
                    self.assertEqual(ms, [m for m in (1, 2, 4, 8) if m % p == 0], (name, p))
                    self.assertGreaterEqual(len(ms), 2)
        for s, p, v, m in points:
            self.assertEqual(z["batch"] % m, 0)  # M divides B (T = D = C = 1)
            self.assertGreaterEqual(z["layers"], p * v)  # each virtual stage has a layer
        self.assertEqual(len(points), 3 * 2 * 4 + 3 + 2)
        self.assertEqual(bench.pp_plan([1, 2], True),  # quick: P = 2, M = 2, 4
                         [("gpipe", 2, 1, 2), ("gpipe", 2, 1, 4), ("1f1b", 2, 1, 2),
                          ("1f1b", 2, 1, 4), ("zb-h1", 2, 1, 2), ("zb-h1", 2, 1, 4),
                          ("interleaved-1f1b", 2, 2, 2), ("interleaved-1f1b", 2, 2, 4)])
        self.assertEqual(bench.pp_plan([1], False), [])  # no P fits one rank

    def test_each_point_runs_with_its_schedule(self):
        import types
        a = types.SimpleNamespace(build="/b", out="/o", work="/w", device="cpu", mpirun="mpirun",
                                  quick=False, ranks=None, repeats=1, model=None, config=None)
        d = bench.Driver(a)
        cmd = d.pp_cmd(("interleaved-1f1b", 4, 2, 8), "x.json")
        self.assertEqual(cmd[:4], ["mpirun", "-np", "4", "/b/bin/09_pipeline_parallel"])
        flag = {f: cmd[cmd.index(f) + 1] for f in ("--pp", "--schedule", "--stages-per-rank",
                                                   "--microbatches", "--batch", "--layers")}
        self.assertEqual(flag, {"--pp": "4", "--schedule": "interleaved-1f1b",
                                "--stages-per-rank": "2", "--microbatches": "8", "--batch": "8",
                                "--layers": "8"})
        for other in ("--dp", "--cp"):  # T = D = C = 1: N = P
            self.assertNotIn(other, cmd)

    def test_a_point_of_the_sweep(self):
        # Three runs: bubbles 0.30, 0.20, 0.25 -> median 0.25, spread 0.20–0.30; step ms after
        # step 0: (4+6)/2 = 5, 3, 7 -> median 5; pp bytes after step 0: 100, 100, 100; live peak
        # per rank the largest over the runs: [4, 3] and [3, 4] and [2, 2] -> "4 4".
        runs = [pp_summary(2, 0.30, 0.2, [50, 4, 6], [9, 100, 100], [4, 3]),
                pp_summary(2, 0.20, 0.2, [50, 3], [9, 100], [3, 4]),
                pp_summary(2, 0.25, 0.2, [50, 7], [9, 100], [2, 2])]
        r = bench.summarise_pp(("1f1b", 2, 1, 4), runs)
        self.assertEqual((r["schedule"], r["p"], r["v"], r["m"], r["n"], r["repeats"]),
                         ("1f1b", 2, 1, 4, 2, 3))
        self.assertAlmostEqual(r["bubble"], 0.25, places=12)
        self.assertAlmostEqual(r["bubble_min"], 0.20, places=12)
        self.assertAlmostEqual(r["bubble_max"], 0.30, places=12)
        self.assertAlmostEqual(r["formula"], 0.2, places=12)
        self.assertAlmostEqual(r["step_ms"], 5.0, places=12)
        self.assertAlmostEqual(r["pp_bytes"], 100.0, places=12)
        self.assertEqual(r["live_peak"], "4 4")
        # ZB-H1 below M = P has no formula: the --json's null (NaN) stays None.
        none = bench.summarise_pp(("zb-h1", 4, 1, 2), [pp_summary(4, 0.5, None, [1, 2], [1, 1],
                                                                  [1, 1, 1, 1])])
        self.assertIsNone(none["formula"])

    ROWS = [{"schedule": "1f1b", "p": 2, "v": 1, "m": 4, "n": 2, "repeats": 3, "steps": 8,
             "bubble": 0.3, "bubble_min": 0.25, "bubble_max": 0.4, "formula": 0.2,
             "step_ms": 10.0, "pp_bytes": 1000.0, "live_peak": "2 1"},
            {"schedule": "1f1b", "p": 2, "v": 1, "m": 2, "n": 2, "repeats": 3, "steps": 8,
             "bubble": 0.5, "bubble_min": 0.5, "bubble_max": 0.6, "formula": 1 / 3,
             "step_ms": 9.0, "pp_bytes": 500.0, "live_peak": "2 1"},
            {"schedule": "zb-h1", "p": 4, "v": 1, "m": 2, "n": 4, "repeats": 3, "steps": 8,
             "bubble": 0.7, "bubble_min": 0.6, "bubble_max": 0.7, "formula": None,
             "step_ms": 20.0, "pp_bytes": 500.0, "live_peak": "2 2 2 1"},
            {"schedule": "zb-h1", "p": 4, "v": 1, "m": 4, "n": 4, "repeats": 3, "steps": 8,
             "bubble": 0.5, "bubble_min": 0.45, "bubble_max": 0.55, "formula": 0.2,
             "step_ms": 30.0, "pp_bytes": 1000.0, "live_peak": "4 3 2 1"}]

    def test_the_plots_lines_are_the_rows(self):
        s = bench.pp_series(self.ROWS)
        self.assertEqual(sorted(s), [("1f1b", 2), ("zb-h1", 4)])
        one = s[("1f1b", 2)]
        self.assertEqual(one["m"], [2, 4])  # M ascending, whatever the rows' order
        self.assertEqual(one["bubble"], [0.5, 0.3])
        for got, want in zip(one["err"][0] + one["err"][1], [0.0, 0.05, 0.1, 0.1]):
            self.assertAlmostEqual(got, want, places=12)
        self.assertEqual(one["formula"], [1 / 3, 0.2])
        self.assertEqual(s[("zb-h1", 4)]["formula"], [None, 0.2])  # no formula below M = P

    def test_the_outputs_are_read_back(self):
        import tempfile
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            self.skipTest("no matplotlib")
        with tempfile.TemporaryDirectory() as tmp:
            out = pathlib.Path(tmp)
            bench.write_csv(self.ROWS, out / "benchmarks" / "cpu_pp.csv", bench.PP_FIELDS)
            svg = bench.plot_pp_bubble(self.ROWS, "cpu", out / "figures").read_text()
            for label in ("P = 2 (N = 2 ranks)", "P = 4 (N = 4 ranks)", "1f1b: measured",
                          "1f1b: formula", "zb-h1: formula", "M (micro-batches)",
                          "cpu backend: the mechanics"):
                self.assertIn(label, svg)
            self.assertNotIn("gpipe", svg)  # a schedule without rows draws nothing
            # GPipe's formula is 1F1B's: one dashed line, named after both.
            gpipe = [dict(r, schedule="gpipe", bubble=0.9, bubble_max=0.95) for r in self.ROWS
                     if r["schedule"] == "1f1b"]
            svg = bench.plot_pp_bubble(self.ROWS + gpipe, "cpu", out / "figures").read_text()
            self.assertIn("gpipe and 1f1b: formula", svg)
            self.assertNotIn("1f1b: formula", svg.replace("gpipe and 1f1b: formula", ""))
            self.assertIn("gpipe: measured (CPU timings)", svg)
            svg = bench.plot_pp_bubble(self.ROWS, "cpu", out / "figures").read_text()
            block = ["<!-- tpx-bench:begin cpu-pp -->", "### Stage 09",
                     "| 1f1b | 2 | 1 | 4 | 0.300 |", "| 1f1b | 2 | 1 | 2 | 0.500 |",
                     "| zb-h1 | 4 | 1 | 2 | 0.700 |", "| zb-h1 | 4 | 1 | 4 | 0.500 |",
                     "<!-- tpx-bench:end cpu-pp -->"]
            doc = ("# B\n\n<!-- tpx-bench:begin cpu -->\n## CPU\n\ntables\n\n"
                   "<!-- tpx-bench:begin cpu-cp -->\ncp\n<!-- tpx-bench:end cpu-cp -->\n\n"
                   "### Micro-benchmarks (cpu)\n\nx\n<!-- tpx-bench:end cpu -->\n")
            text = bench.replace_subsection(doc, "cpu", "pp", block)
            self.assertLess(text.index("end cpu-cp"), text.index("begin cpu-pp"))  # after 08's
            self.assertLess(text.index("end cpu-pp"), text.index("### Micro-benchmarks"))
            self.assertEqual(bench.replace_subsection(text, "cpu", "pp", block), text)
            (out / "benchmarks.md").write_text(text)
            expected = [("1f1b", 2, 1, 4), ("1f1b", 2, 1, 2), ("zb-h1", 4, 1, 2),
                        ("zb-h1", 4, 1, 4)]
            self.assertEqual(bench.verify_pp(out, "cpu", expected), [])
            # A point that did not run, and a row the page lacks:
            problems = bench.verify_pp(out, "cpu", expected + [("gpipe", 4, 1, 8)])
            self.assertEqual(len(problems), 1, problems)
            (out / "benchmarks.md").write_text(text.replace("| zb-h1 | 4 | 1 | 4 |",
                                                            "| zb-h1 | 4 | 2 | 4 |"))
            self.assertEqual(len(bench.verify_pp(out, "cpu", expected)), 1)
            (out / "benchmarks.md").write_text(text)
            # A formula missing where the schedule has one, a bubble outside its spread, live
            # counts for the wrong number of ranks, no pp bytes:
            bad = [dict(self.ROWS[0], formula=None), dict(self.ROWS[1], bubble=0.7),
                   dict(self.ROWS[2], live_peak="2 2"), dict(self.ROWS[3], pp_bytes=0.0)]
            bench.write_csv(bad, out / "benchmarks" / "cpu_pp.csv", bench.PP_FIELDS)
            problems = bench.verify_pp(out, "cpu", expected)
            self.assertEqual(len(problems), 4, problems)
            for word, p in zip(("formula", "bubble", "live_peak", "pp_bytes"), problems):
                self.assertIn(word, p)
            (out / "figures" / "bench_cpu_pp_bubble.svg").unlink()
            self.assertEqual(len(bench.verify_pp(out, "cpu", expected)), 1)  # the plot is gone


RUN = bench.ROOT / "docs" / "gpu-runs" / "2026-11-27-h100"  # the committed logs of a GPU run


def broken(src, tmp, drop=None, replace=None):
    """A copy of the log src under tmp with the lines matching drop removed (or replace applied)."""
    text = src.read_text()
    if drop:
        text = "\n".join(ln for ln in text.split("\n") if drop not in ln)
    if replace:
        text = text.replace(*replace)
    path = pathlib.Path(tmp) / src.name
    path.write_text(text)
    return path


class GpuLogs(unittest.TestCase):
    """tools/gpu_logs.py on the committed logs of the 2026-11-27 H100 run, and on broken copies."""

    @classmethod
    def setUpClass(cls):
        cls.logs = gpu_logs.load_run(RUN)

    def test_the_stage_and_pytorch_steps(self):
        big, torch = self.logs["big"], self.logs["torch"]
        self.assertEqual(big["step_ms"], 22.74)
        self.assertEqual(big["peak_tflops"], 809.2)
        self.assertEqual(big["sizes"]["ffn"], 11008)
        self.assertEqual(big["device"], {"name": "NVIDIA H100 80GB HBM3", "arch": "sm_90",
                                         "sms": 132, "memory_gib": 79.2})
        self.assertEqual((torch["eager"]["step_ms"], torch["compile"]["step_ms"]), (7.657, 5.886))
        self.assertEqual(self.logs["driver"], "580.159.04")
        self.assertEqual(self.logs["commit"], "ca299f2")

    def test_micro_benchmarks(self):
        gemms = gemm_logs = gpu_logs.gemm_rows(self.logs)
        self.assertEqual(len(gemms), 9)
        self.assertEqual(min(g["tflops"] for g in gemm_logs), 434.17)
        self.assertEqual(max(g["tflops"] for g in gemm_logs), 519.814)
        self.assertEqual(gpu_logs.gemm_rows(self.logs, "fp8"), [])
        self.assertIn("CUBLAS_STATUS_NOT_SUPPORTED", self.logs["gemm"]["aborted"])
        slow = {c["mover"]: c["slowdown"] for c in gpu_logs.copy_rows(self.logs)
                if c["size"] == 4096}
        self.assertEqual((slow["copy_engine"], slow["sm_copy"], slow["nccl"]),
                         (1.2029, 1.66016, 1.37622))
        att = {(r["kernel"], r["seq"]): r for r in gpu_logs.attention_rows(self.logs)}
        self.assertEqual(att["fused", 2048]["ms"], 15.2)
        self.assertEqual(att["sdpa", 8192]["tflops"], 539.7)
        self.assertEqual(att["naive", 8192]["peak_mib"], 25344.0)  # printed 25.344k
        self.assertAlmostEqual(att["fused", 2048]["vs_sdpa"], 15.2 / 0.356)

    def test_nsight_compute_groups(self):
        groups, attention, total = gpu_logs.ncu_groups(self.logs["ncu"])
        self.assertEqual(self.logs["ncu"]["launches"], 240)
        by = {g: (n, ms) for g, n, ms, _ in groups}
        # flash_forward_tc 1 × 5.09, flash_dq_tc 2 × 5.25, flash_dkdv_tc 2 × 7.19 ms
        n, ms = by["attention (flash_forward_tc, flash_dq_tc, flash_dkdv_tc)"]
        self.assertEqual(n, 5)
        self.assertAlmostEqual(ms, 5.09 + 2 * 5.25 + 2 * 7.19)
        self.assertEqual(by["GEMMs (cuBLASLt nvjet)"][0], 38)
        self.assertEqual(by["bf16 ↔ fp32 conversions"][0], 59 + 43)
        self.assertNotIn("other", by)  # every kernel of the step has its group
        self.assertEqual(groups[0][0], "attention (flash_forward_tc, flash_dq_tc, flash_dkdv_tc)")
        self.assertAlmostEqual(sum(share for *_, share in groups), 1.0)

    def test_the_tensor_core_kernels_group_as_attention(self):
        # The mma.sync kernels' demangled names, as ncu prints them without the namespace.
        for short in ("flash_forward_mma<128, __nv_bfloat16>", "flash_bwd_mma<64, float>"):
            group = next((g for g, p in gpu_logs.NCU_GROUPS if re.search(p, short)), "other")
            self.assertEqual(group, "attention (flash_forward_mma, flash_bwd_mma)", short)
        self.assertNotRegex("flash_delta_kernel<true>", gpu_logs.NCU_GROUPS[1][1])

    def test_a_log_missing_its_line_names_the_file(self):
        with tempfile.TemporaryDirectory() as tmp:
            for parse, src, drop, where in [
                    (gpu_logs.stage_log, RUN / gpu_logs.FILES["big"], "mean step", "mean step"),
                    (gpu_logs.torch_log, RUN / gpu_logs.FILES["torch"], "torch compile:",
                     "torch compile"),
                    (gpu_logs.gbench_console, RUN / gpu_logs.FILES["gemm"], "tpx_device_cuda",
                     "device line"),
                    (gpu_logs.sdpa_log, RUN / gpu_logs.FILES["sdpa"], "sdpa_bench:", "sdpa_bench"),
                    (gpu_logs.report_md, RUN / gpu_logs.FILES["report"], "- commit:", "commit"),
                    # one launch fewer than the summary counts
                    (gpu_logs.ncu_summary, RUN / gpu_logs.FILES["ncu"], '"rope_kernel" - 59',
                     "invocations")]:
                path = broken(src, tmp, drop=drop)
                with self.assertRaises(gpu_logs.LogError) as e:
                    parse(path)
                self.assertIn(str(path), str(e.exception))
                self.assertIn(where, str(e.exception))
            bad = broken(RUN / gpu_logs.FILES["gemm"], tmp, replace=("TFLOP/s=434.17",
                                                                     "TFLOP/s=fast"))
            with self.assertRaisesRegex(gpu_logs.LogError, "not a number"):
                gpu_logs.gbench_console(bad)
        with self.assertRaisesRegex(gpu_logs.LogError, "cannot read"):
            gpu_logs.load_run(pathlib.Path("/nonexistent/run"))

    def test_console_rows_as_google_benchmark_json(self):
        j = gpu_logs.gbench_json(self.logs["gemm"])
        b = j["benchmarks"][0]
        self.assertEqual(b["name"], "gemm/cuda/bf16/wq/fwd/real_time")
        self.assertEqual(b["label"], "m=2048 n=4096 k=4096")  # what tpx_project --calibrate reads
        self.assertEqual(b["TFLOP/s"], 434.17)

    def test_the_device_files_measured_block(self):
        # 12·H / (7·NH·D) = 12/7 times the bench's TFLOP/s over the peak: the model's FLOPs.
        self.assertAlmostEqual(gpu_logs.model_attention_efficiency(7.0, 1e15, 32, 128, 4096),
                               0.012)
        m = gpu_logs.measured_block(self.logs, 989.4e12, "RUN")
        self.assertEqual(m["gemm_efficiency"]["points"][-1],
                         [2.0 * 8192 ** 3, round(809.2 / 989.4, 4)])  # the stage's 8192³ peak
        self.assertEqual(len(m["gemm_efficiency"]["points"]), 3)  # 6.9e10, 1.8e11, 1.1e12 FLOPs
        self.assertEqual(gpu_logs.check_device_file(
            bench.ROOT / "tools/devices/h100_sxm.json", self.logs, str(RUN.relative_to(
                bench.ROOT))), [])
        with tempfile.TemporaryDirectory() as tmp:
            j = json.loads((bench.ROOT / "tools/devices/h100_sxm.json").read_text())
            j["measured"]["gemm_efficiency"]["points"][0][1] = 0.9
            f = pathlib.Path(tmp) / "h100_sxm.json"
            f.write_text(json.dumps(j))
            problems = gpu_logs.check_device_file(f, self.logs, "docs/gpu-runs/2026-11-27-h100")
            self.assertEqual(len(problems), 1)
            self.assertIn("measured.gemm_efficiency", problems[0])


@unittest.skipUnless(importlib.util.find_spec("matplotlib"), "the plot needs matplotlib")
class FromLogs(unittest.TestCase):
    def test_the_section_is_written_from_the_logs(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = pathlib.Path(tmp)
            rc = bench.main(["--from-logs", str(RUN), "--out", tmp, "--command", "CMD"])
            self.assertEqual(rc, 0)
            text = (out / "benchmarks.md").read_text()
            body = bench.section_body(text, "cuda")
            self.assertIn("NVIDIA H100 80GB HBM3, sm_90, 132 SMs", body)
            self.assertIn("driver 580.159.04", body)
            self.assertIn("Commit `ca299f2`", body)
            self.assertIn("**tpx is 3.0× slower than PyTorch eager today**", body)  # 22.74 / 7.657
            self.assertIn("| tpx 01_baseline (fused attention) | 22.74 |", body)
            self.assertIn("| PyTorch SDPA | 8192 | 3.56 | 539.7 | 1.0× | — |", body)
            self.assertIn("434–520 TFLOP/s, 54–64 % of the measured 809.2 TFLOP/s", body)
            self.assertIn("No FP8 rows", body)
            self.assertIn("1.20× as long beside a copy-engine copy, 1.66× beside an SM copy "
                          "kernel and 1.38× beside NCCL", body)
            self.assertIn("| attention (flash_forward_tc, flash_dq_tc, flash_dkdv_tc) | 5 | "
                          "29.97 | 67.9 % |", body)
            self.assertIn("share it", body)  # the multi-rank caveat
            self.assertIn("`CMD`", body)
            self.assertIn("--from-logs", text.split("<!-- tpx-bench:begin")[0])  # the intro
            rows = bench.read_csv_rows(out / "benchmarks" / "cuda_run.csv")
            step = [r for r in rows if r["what"] == "tpx 01_baseline" and r["metric"] == "step_ms"]
            self.assertEqual(step[0]["value"], "22.74")
            self.assertTrue((out / "figures" / "bench_cuda_attention.svg").stat().st_size > 0)

    def test_a_broken_run_writes_nothing(self):
        with tempfile.TemporaryDirectory() as tmp:
            run = pathlib.Path(tmp) / "run"
            shutil.copytree(RUN, run)
            big = run / gpu_logs.FILES["big"]
            big.write_text(big.read_text().replace("mean step", "average step"))
            out = pathlib.Path(tmp) / "out"
            out.mkdir()
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc = bench.main(["--from-logs", str(run), "--out", str(out)])
            self.assertEqual(rc, 1)
            self.assertIn("01-01.big.bf16.log: no 'mean step … ms' line", err.getvalue())
            self.assertFalse((out / "benchmarks.md").exists())


class MeasuredCheck(unittest.TestCase):
    def test_error_line(self):
        self.assertEqual(bench.error_line(4.83, 22.74), "4.7× too fast")  # 22.74 / 4.83 = 4.71
        self.assertEqual(bench.error_line(20.66, 22.74), "-9.1 %")
        self.assertEqual(bench.error_line(50.0, 20.0), "2.5× too slow")

    def test_the_projection_states_its_error_first(self):
        # A stand-in tpx_project that projects 01_baseline at 4.83 ms under --assumed, else 20.66.
        with tempfile.TemporaryDirectory() as tmp:
            exe = pathlib.Path(tmp) / "tpx_project"
            exe.write_text("#!/bin/sh\nms=20.66\nfor a in \"$@\"; do [ \"$a\" = --assumed ] && "
                           "ms=4.83; done\nwhile [ \"$1\" != --json ]; do shift; done\n"
                           "echo \"{\\\"stages\\\": [{\\\"stage\\\": \\\"01_baseline\\\", "
                           "\\\"step_ms\\\": $ms}]}\" > \"$2\"\n")
            exe.chmod(0o755)
            lines = bench.measured_check(exe, bench.GPU_DEVICE_FILE, pathlib.Path(tmp), 30, RUN)
        text = "\n".join(lines)
        self.assertTrue(lines[0].startswith("**First, the model against the one measured GPU "
                                            "step**"))
        self.assertIn("measured 22.74 ms", lines[0])
        self.assertIn("| `--assumed` | 4.83 | tpx 22.74 | 4.7× too fast |", text)
        self.assertIn("| `--attention fused` | 20.66 | tpx 22.74 | -9.1 % |", text)
        self.assertIn("PyTorch eager 7.66, torch.compile 5.89", text)


class GpuCompare(unittest.TestCase):
    """gpu_logs.compare: the bench part's table from logs written here by hand."""

    GBENCH = """2030-01-02T03:04:05+00:00
tpx_device_cuda: Test GPU (sm_90, 100 SMs, 80.0 GiB)
----------------------------------------------------------------
Benchmark                                      Time             CPU   Iterations UserCounters...
----------------------------------------------------------------
attention/cuda/bf16/fused/S:1024/real_time       2.00 ms         2.00 ms           10 TFLOP/s=30 peak_MiB=1
attention/cuda/bf16/naive/S:1024/real_time       4.00 ms         4.00 ms           10 TFLOP/s=15 peak_MiB=9
attention/cuda/bf16/fused/S:2048/D:64/real_time  1.00 ms         1.00 ms           10 TFLOP/s=60 peak_MiB=1
"""
    SDPA = ("sdpa_bench: Test GPU, torch 9.9, bf16, fwd+bwd\n"
            "attention/cuda/bf16/sdpa/S:1024  B=1 NH=32 D=128  0.500 ms  TFLOP/s=120.0\n")
    SDPA64 = ("sdpa_bench: Test GPU, torch 9.9, bf16, fwd+bwd\n"
              "attention/cuda/bf16/sdpa/S:2048/D:64  B=1 NH=32 D=64  0.250 ms  TFLOP/s=240.0\n")
    STAGE = """tpx 01_baseline | single device
ranks 1 | device cuda | dtype bf16 | attention fused | comm none
H 64 NH 4 NKV 4 (D 16) F 128 S 32 B 1 L 1 | steps 5
gpu Test GPU (sm_90, 100 SMs, 80.0 GiB) | bf16 GEMM peak 500.0 TFLOP/s (measured by rank 0 alone before the steps: x) | 1.5 TFLOP per step per rank (GEMMs, flops.h)
mean step 12.00 ms (exposed comm 0.00 ms; steps 1-4, step 0 warms up)
"""
    TORCH = ("torch eager: mean step 4.000 ms, 1.0 TFLOP/s (model FLOPs)\n"
             "torch compile: mean step 3.000 ms, 1.3 TFLOP/s (model FLOPs)\n")

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.logs = pathlib.Path(self.dir.name)
        for name, text in (("03-bench_attention.log", self.GBENCH), ("04-sdpa_bench.log", self.SDPA),
                           ("05-sdpa_bench.d64.log", self.SDPA64),
                           ("06-torch_block_perf.log", self.TORCH),
                           ("07-01.big.bf16.bench.log", self.STAGE)):
            (self.logs / name).write_text(text)

    def tearDown(self):
        self.dir.cleanup()

    def test_every_kernel_beside_sdpa_and_the_step_beside_pytorch(self):
        text = "\n".join(gpu_logs.compare(self.logs))
        # S 1024, D 128: fused 30 / 120 = 0.250 of SDPA's TFLOP/s, naive 15 / 120 = 0.125.
        self.assertIn("| 1024 | 128 | 2 ms, 30.0 | 4 ms, 15.0 | 0.5 ms, 120.0 | 0.250 | 0.125 |",
                      text)
        # S 2048, D 64: fused 60 / 240 = 0.250; no naive row at that shape.
        self.assertIn("| 2048 | 64 | 1 ms, 60.0 | — | 0.25 ms, 240.0 | 0.250 | — |", text)
        # 12 / 4 = 3.00× eager, 12 / 3 = 4.00× compile.
        self.assertIn("| 12.00 | 4.00 | 3.00 | 3.00× | 4.00× |", text)
        self.assertNotIn("not in this run", text)

    def test_a_missing_log_is_named_not_guessed(self):
        (self.logs / "06-torch_block_perf.log").unlink()
        (self.logs / "04-sdpa_bench.log").write_text("sdpa_bench: PyTorch is not installed here\n")
        text = "\n".join(gpu_logs.compare(self.logs))
        self.assertIn("| 12.00 | — | — | — | — |", text)
        self.assertIn("not in this run: PyTorch's step", text)
        self.assertIn("not in this run: SDPA (04-sdpa_bench.log has no timings", text)
        self.assertIn("| 1024 | 128 | 2 ms, 30.0 | 4 ms, 15.0 | — | — | — |", text)


class TorchBlockFlops(unittest.TestCase):
    def test_model_flops_by_hand(self):
        spec = importlib.util.spec_from_file_location(
            "torch_block_perf", pathlib.Path(__file__).resolve().parent / "torch_block_perf.py")
        tbp = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tbp)
        # H 4, NH 2 (D 2), NKV 1, F 8, S 3, B 1: projections 2·3·(2·16 + 2·4·2 + 3·32) = 864,
        # attention 2·1·2·9·2 = 72; a step is 3 × 936 = 2808.
        self.assertEqual(tbp.model_flops(4, 2, 1, 8, 3, 1, 1), 2808)
        self.assertEqual(tbp.model_flops(4, 2, 1, 8, 3, 1, 2), 2 * 2808)


if __name__ == "__main__":
    unittest.main()
