"""The device's section of docs/benchmarks.md as markdown, from the rows of the runs.
"""
import os

from .config import (CP_STAGE, MESH_STAGES, PP_MICROBATCHES, PP_SCHEDULES, PP_SIZES, PP_STAGE,
                     REFERENCE_STAGE, rel, size_text, sizes, stage_label)
from .arithmetic import cp_plan, left_out_list, pp_plan
from .tables import COLUMNS, _f, md_table
from .page import fenced, mesh_points_of, ran_text
from .microbench import size_label


def oversubscribed(row):
    """A cpu point with more ranks than cores: its ranks take turns on the cores, so its time
    says nothing about the stage's speed."""
    return row.get("device") == "cpu" and int(row.get("n") or 0) > (os.cpu_count() or 1)


def cell(row, key, fmt):
    """One table cell; the speed-up of an oversubscribed cpu point is not shown."""
    if key == "speedup" and oversubscribed(row):
        return "— (N > cores)"
    return fmt(row.get(key))


class Render:
    def __init__(self, d, device_text):
        self.d, self.a = d, d.a
        self.device_text = device_text

    def caption(self, how, cmd):
        """The lines under every table: its device, date and command. The command stands in a
        fenced block, where its quotes stay straight and it can be copied as it is."""
        return [f"Device: {self.device_text}. Date: {self.d.date}. {how}:", "", *fenced(cmd)]

    def stage_section(self, stages, rows, skipped, refused, peak, gemm_cmd, loads):
        a, d = self.a, self.d
        out = [f"## {a.device.upper()}", ""]
        out.append(f"Device: {self.device_text}. Date: {d.date}. Command: `{a.command}` "
                   f"(build: `{rel(d.build)}`).")
        out.append("")
        if a.device == "cpu":
            cores = os.cpu_count() or 1
            over = [n for n in d.ranks if n > cores]
            crowd = (f"; N = {', '.join(map(str, over))} oversubscribes them, and its speed-up "
                     "is not shown: ranks that take turns on a core time the scheduler, not the "
                     "stage" if over else "")
            out.append("**These are CPU-backend timings: they show the mechanics (the bytes each "
                       "rank moves, the structure of the overlap, the relative cost of the stages), "
                       "not GPU speed.** Ranks share the machine's cores (one BLAS thread each, "
                       f"{cores} cores{crowd}).")
            out.append("")
        out += self.load_line(loads, "the sweep")
        out.append(ran_text(stages, d.ranks, d.configs, d.repeats, d.steps, a.quick,
                            mesh_points_of(rows)))
        out.append("")
        out.append(f"Each point: {d.repeats} run(s) of `--steps {d.steps}`; a run's step time is "
                   "the mean over steps 1 … (step 0 warms up); the table gives the median over "
                   "the runs and the spread as min–max. TFLOP/s per rank = the rank's GEMM FLOPs "
                   "per step (`flops_per_step_per_rank`, `common/flops.h`) / step time; comm bus "
                   "GB/s = bus bytes per step per rank / step time (10⁹ B/s); peak MiB is the "
                   "allocator's peak of the run; saved act MiB the activations each rank keeps "
                   "for backward; speed-up vs 03 = step time of stage 03 / step time (same config "
                   "and N, > 1 is faster).")
        out.append("")
        if peak:
            kind = "bf16" if a.device == "cuda" else "fp32 SGEMM, one BLAS thread"
            out.append(f"MFU per rank is against a measured peak of **{peak['tflops']:.4f} "
                       f"TFLOP/s** ({kind}): `bench_gemm`'s largest {peak['dtype']} GEMM, "
                       f"`gemm/{a.device}/{peak['dtype']}/{peak['gemm']}` (m={peak['m']} "
                       f"n={peak['n']} k={peak['k']}), run before the stages as:")
            out.append("")
            out += fenced(gemm_cmd)
        else:
            out.append("MFU per rank: — (no peak was measured: `bench_gemm` did not run, see "
                       "below; no peak is assumed).")
        out.append("")
        if REFERENCE_STAGE not in stages:
            out.append(f"Speed-up vs 03: — (`{REFERENCE_STAGE}` is not built).")
            out.append("")
        for config in d.configs:
            table = [r for r in rows if r["config"] == config["name"]]
            s = table[0] if table else sizes(config) if "flags" not in config else None
            out.append(f"### {config['name']}: {size_text(s) if s else 'sizes as the preset sets them'}")
            out.append("")
            if config["name"] in refused:
                out.append(f"Not run: {refused[config['name']]}")
                out.append("")
                continue
            out.append(f"{config['why'][0].upper()}{config['why'][1:]}.")
            out.append("")
            table = [r for r in rows if r["config"] == config["name"]]
            head = [h for _, h, _ in COLUMNS if h]
            out.append(md_table(head, [[cell(r, k, f) for k, h, f in COLUMNS if h] for r in table]))
            out.append("")
            example = d.stage_cmd("<stage>", "<N>", config, "<file>")
            out += self.caption(f"Each point run by `{a.command}` as", example)
            out.append("")
        out += left_out_list(skipped)
        dev = a.device
        out.append("Step time per stage against N (error bars: min–max over the runs), exposed "
                   "communication (the time a counted comm or copy span runs with no compute span "
                   "beside it) against N, and each stage's step split into compute and exposed "
                   "communication at the largest N it ran at:")
        out.append("")
        for kind in ("step_ms", "exposed_comm", "breakdown"):
            out.append(f"![{dev} {kind}](figures/bench_{dev}_{kind}.svg)")
        out.append("")
        out.append(f"The table as CSV: [benchmarks/{dev}.csv](benchmarks/{dev}.csv).")
        return out

    def load_line(self, loads, what, shows="exposed comm"):
        if None in loads:
            return []
        return [f"The machine's 1-minute load average was {loads[0]:.2f} when {what} started and "
                f"{loads[1]:.2f} when it ended: other work on it widens the spread, and a rank "
                f"that is not scheduled shows up as {shows} on its peers.", ""]

    def subsection_head(self, name, title, loads, shows="exposed comm"):
        """A subsection's first lines: its begin marker, heading, device, date, command and the
        load average around its sweep (its own: --only NAME reruns it alone)."""
        a, d, dev = self.a, self.d, self.a.device
        return [f"<!-- tpx-bench:begin {dev}-{name} -->", f"### {title} ({dev})", "",
                f"Device: {self.device_text}. Date: {d.date}. Command: `{a.command}` "
                f"(build: `{rel(d.build)}`).", "", *self.load_line(loads, "this sweep", shows)]

    def pp_section(self, rows, left_out, loads):
        """Stage 09's subsection, between its own markers (tools/bench.py --only pp replaces it
        alone): per schedule and P the measured bubble against M beside the formula's, table
        and plot."""
        a, d, dev = self.a, self.d, self.a.device
        out = self.subsection_head("pp", "Stage 09: pipeline schedules, measured bubble", loads,
                                   "idle time")
        points = pp_plan(d.ranks, a.quick)
        degrees = sorted({p for _, p, _, _ in points})
        scheds = ", ".join(f"`{s}` (V = {v})" for s, v in PP_SCHEDULES)
        ms = ", ".join(map(str, PP_MICROBATCHES[a.quick]))
        out.append(f"`{PP_STAGE}` with the schedules {scheds} at P = "
                   f"{', '.join(map(str, degrees))} (N = P ranks, T = D = C = 1) over M = {ms} "
                   f"micro-batches (interleaved only where P divides M); sizes "
                   f"{size_text(PP_SIZES[a.quick])}, small so that a run takes seconds; {d.repeats} "
                   f"repeat{'s' if d.repeats > 1 else ''} of {d.steps} steps per point.")
        out.append("")
        out.append("Measured bubble: the stage's `--json` `pipeline.bubble_measured`, the idle "
                   "time (a rank waiting for a peer's activation or gradient, or between its "
                   "actions) summed over the pipeline's ranks over their summed wall time, steps "
                   "1 … (step 0 warms up); the table gives the median over the runs and the "
                   "spread as min–max. Formula: `pipeline.bubble_formula`, the schedule's bubble "
                   "with unit costs F = B = W (`09_pipeline_parallel/schedule.cc`): "
                   "(P−1)/(M+P−1) for GPipe and 1F1B, (P−1)/(V·M+P−1) interleaved, "
                   "(P−1)/(3M+P−1) for ZB-H1 (its deferred W's fill the wait), which has none "
                   "below M = P (—). Step ms: "
                   "the mean over steps "
                   "1 …, median over the runs; pp bytes: the point-to-point bus bytes per step "
                   "per rank (`pp_bus_bytes`); live peak: the most micro-batches whose "
                   "activations each pipeline rank held at once, rank 0 first.")
        out.append("")
        if a.device == "cpu":
            cores = os.cpu_count() or 1
            crowd = (f" At P = {', '.join(str(p) for p in degrees if p > cores)} the ranks "
                     f"outnumber the {cores} cores: a rank that is not scheduled counts as idle "
                     "on its peers, so those bubbles are the scheduler's as much as the "
                     "schedule's." if any(p > cores for p in degrees) else "")
            out.append("**CPU timings: the bubble's mechanics, not GPU speed.**" + crowd)
            out.append("")
        out.append(md_table(["schedule", "P", "V", "M", "bubble measured (median)",
                             "spread (min–max)", "bubble formula", "step ms (median)",
                             "pp bytes per step", "live peak per rank"],
                            [[r["schedule"], r["p"], r["v"], r["m"], f"{r['bubble']:.3f}",
                              f"{r['bubble_min']:.3f}–{r['bubble_max']:.3f}",
                              _f(3)(r["formula"]), f"{r['step_ms']:.2f}",
                              f"{r['pp_bytes']:.0f}", r["live_peak"]] for r in rows]))
        out.append("")
        example = d.pp_cmd(("<schedule>", "<P>", "<V>", "<M>"), "<file>")
        out += self.caption(f"Each point run by `{a.command}` as", example)
        out.append("")
        out += left_out_list(left_out)
        out.append(f"![{dev} pp_bubble](figures/bench_{dev}_pp_bubble.svg)")
        out.append("")
        out.append(f"The table as CSV: [benchmarks/{dev}_pp.csv](benchmarks/{dev}_pp.csv).")
        out.append(f"<!-- tpx-bench:end {dev}-pp -->")
        return out

    def cp_section(self, rows, att, left_out, loads, peak):
        """Stage 08's subsection, between its own markers (tools/bench.py --only cp replaces
        it alone): its stage table per S, then attention time against S, table and plot."""
        a, d, dev = self.a, self.d, self.a.device
        out = self.subsection_head("cp", "Stage 08: context parallelism", loads)
        table, attention = cp_plan(d.ranks, a.quick, a.device)
        meshes = ", ".join(f"C {c} × T {n // c}" for n, c in MESH_STAGES[CP_STAGE][3]
                           if n in d.ranks)
        refs = sorted({n for _, s, n in table if s == REFERENCE_STAGE})
        seqs = sorted({s for s, _, _ in table})
        att_seqs = sorted({s for s, _ in attention})
        att_c = sorted({c for _, c in attention})
        out.append(f"`{CP_STAGE}` with its default ring (`--cp-method ring`) on the meshes "
                   f"{meshes}, beside `{REFERENCE_STAGE}` at N = {', '.join(map(str, refs))} "
                   f"(C 1 × T N: the speed-up's reference, run in this sweep), at S = "
                   f"{', '.join(map(str, seqs))}; then attention time against S for C = "
                   f"{', '.join(map(str, att_c))} (N = C, T = 1) at S = "
                   f"{', '.join(map(str, att_seqs))}. The other sizes are the default config's; "
                   f"{d.repeats} repeat{'s' if d.repeats > 1 else ''} of {d.steps} steps per "
                   "point, every run with `--trace` (the same small cost at every point). The "
                   "columns are the stage tables' above; a point's step time, spread and "
                   "derived columns are taken the same way.")
        out.append("")
        out.append(f"MFU per rank is against the peak `bench_gemm` measured before this sweep, "
                   f"**{peak['tflops']:.4f} TFLOP/s** (`gemm/{a.device}/{peak['dtype']}/"
                   f"{peak['gemm']}`)." if peak else
                   "MFU per rank: — (no peak was measured: `bench_gemm` did not run).")
        out.append("")
        if a.device == "cpu" and any(n > (os.cpu_count() or 1) for _, _, n in table):
            out.append(f"At N = 4 four ranks share the {os.cpu_count()} cores: those points time "
                       "the scheduler as much as the stage (their speed-up is not shown).")
            out.append("")
        head = ["stage", "C × T"] + [h for k, h, _ in COLUMNS if h and k != "stage"]
        for seq in seqs:
            config = d.cp_config(seq)
            mine = [r for r in rows if r["config"] == config["name"]]
            out.append(f"#### S = {seq}: {size_text(sizes(config))}")
            out.append("")
            out.append(f"{config['why'][0].upper()}{config['why'][1:]}.")
            out.append("")
            out.append(md_table(head, [[r["stage"], f"{r['c']} × {r['t']}"] +
                                       [cell(r, k, f) for k, h, f in COLUMNS
                                        if h and k != "stage"] for r in mine]))
            out.append("")
            example = d.stage_cmd("<stage>", "<N>", config, "<file>") + ["--trace", "<file>"]
            out += self.caption(f"Each point run by `{a.command}` as (stage 08 with `--cp <C>`)",
                                example)
            out.append("")
        out += left_out_list(left_out)
        out.append("#### Attention time against S")
        out.append("")
        if not attention:
            out.append(f"Not run on {dev}: `--cp > 1` runs on the cpu backend only in this build, "
                       "and a trace span times the host, not the GPU's kernels.")
            out.append(f"<!-- tpx-bench:end {dev}-cp -->")
            return out
        out.append("Measured the same way at every C, from each run's `--trace`: on each rank, the "
                   "`attention fwd` and `attention bwd` spans of its compute lane (the spans "
                   "`common/block.cc` opens around the block's whole attention) summed within "
                   "each step; the mean over steps 1 … (step 0 warms up) and over the ranks; the "
                   "median over the runs, with the spread min–max. At C = 1 stage 08 builds "
                   "stage 07 alone and those spans hold the fused attention kernel over the whole "
                   "sequence (its `--json` `cp_attention_ms` is 0 there: no ring); at C > 1 they "
                   "hold the ring's C steps forward and backward, the log-sum-exp merges and the "
                   "waits for K/V and dK/dV blocks between the steps. `ring steps ms` is the "
                   "spans of those steps alone (`attention fwd ring step …`, nested in the "
                   "former), taken the same way: the attention blocks without the waits, the "
                   "time the stage's own `cp_attention_ms` counts (the CSV has rank 0's, from "
                   "`--json`, beside it); — at C = 1. `attention / step` is the attention time "
                   "over the step time.")
        out.append("")
        if a.device == "cpu" and any(c > (os.cpu_count() or 1) for _, c in attention):
            out.append(f"At C = 4 four ranks share the {os.cpu_count()} cores, so a ring step "
                       "also waits for a peer that is not running: those points show the ring's "
                       "structure, not what four cores would give.")
            out.append("")
        out.append(md_table(["S", "C", "N", "attention ms per step (median)", "spread (min–max)",
                             "ring steps ms", "step ms (median)", "attention / step"],
                            [[r["seq"], r["c"], r["n"], f"{r['attention_ms']:.2f}",
                              f"{r['attention_ms_min']:.2f}–{r['attention_ms_max']:.2f}",
                              _f(2)(r["blocks_ms"]), f"{r['step_ms']:.2f}",
                              f"{100 * r['share']:.1f} %"] for r in att]))
        out.append("")
        example = d.stage_cmd(stage_label(CP_STAGE, "<C>"), "<C>", {"set": {"seq": "<S>"}},
                              "<file>") + ["--trace", "<file>"]
        out += self.caption(f"Each point run by `{a.command}` as", example)
        out.append("")
        out.append(f"![{dev} cp_attention](figures/bench_{dev}_cp_attention.svg)")
        out.append("")
        out.append(f"The tables as CSV: [benchmarks/{dev}_cp.csv](benchmarks/{dev}_cp.csv), "
                   f"[benchmarks/{dev}_cp_attention.csv](benchmarks/{dev}_cp_attention.csv).")
        out.append(f"<!-- tpx-bench:end {dev}-cp -->")
        return out

    def gemm_section(self, gemm, chunked, cmd, note):
        a = self.a
        out = [f"#### GEMM throughput ({a.device})", ""]
        if note:
            return out + [note, ""]
        if a.device == "cpu":
            out.append("fp8 rows on the cpu dequantize their operands and run the fp32 GEMM: they "
                       "show what the emulation costs, not FP8 speed.")
            out.append("")
        out.append(md_table(["dtype", "GEMM", "m", "n", "k", "time us", "TFLOP/s"],
                            [[g["dtype"], g["gemm"], g["m"], g["n"], g["k"], f"{g['us']:.1f}",
                              f"{g['tflops']:.4f}"] for g in gemm]))
        out.append("")
        out += self.caption(f"Run by `{a.command}` as", cmd)
        out.append("")
        out.append(f"#### Chunked GEMM efficiency ({a.device})")
        out.append("")
        if not chunked:
            out.append("`bench_gemm` has no `gemm_chunked` rows in this build.")
            out.append("")
            return out
        out.append("A GEMM split into N chunks, as the ring stages run it: efficiency = the "
                   "unsplit GEMM's time / the N chunks' total time (`bench_gemm`'s `efficiency` "
                   "counter; 1 = no loss).")
        out.append("")
        ns = sorted({c["n"] for c in chunked})
        keys = []
        for c in chunked:
            if (c["dtype"], c["gemm"]) not in keys:
                keys.append((c["dtype"], c["gemm"]))
        cell = {(c["dtype"], c["gemm"], c["n"]): c["efficiency"] for c in chunked}
        out.append(md_table(["dtype", "GEMM"] + [f"N={n}" for n in ns],
                            [[dt, g] + [f"{cell[(dt, g, n)]:.3f}" if (dt, g, n) in cell else "—"
                                        for n in ns] for dt, g in keys]))
        out.append("")
        out += self.caption(f"Run by `{a.command}` as", cmd)
        out.append("")
        return out

    def collectives_section(self, results):
        a = self.a
        out = [f"#### Collectives ({a.device})", ""]
        intro = False
        for n, ops, cmd, note in results:
            if note and not ops:
                out += [note, ""]
                continue
            if not intro:
                out.append("nccl-tests' convention: algbw = size / time; busbw = algbw × 2(N−1)/N "
                           "(all_reduce), × (N−1)/N (all_gather, reduce_scatter, symm_pull), × 1 "
                           "(broadcast, sendrecv); time is the slowest rank's; `#wrong` counts "
                           "elements that differ from the known result.")
                out.append("")
                intro = True
            if note:
                out += [f"**{note}**", ""]
            for op, rows in ops.items():
                wrong = sum(r["wrong"] for r in rows)
                out.append(f"**{op}, N={n}**")
                out.append("")
                if wrong:
                    out.append(f"**WRONG RESULTS: {wrong} element(s) of {op} at N={n} differ from "
                               "the known result (`#wrong` below).**")
                    out.append("")
                out.append(md_table(["size", "count", "time us", "algbw GB/s", "busbw GB/s",
                                     "`#wrong`"],
                                    [[size_label(r["bytes"]), r["count"], f"{r['us']:.1f}",
                                      f"{r['algbw']:.3f}", f"{r['busbw']:.3f}",
                                      f"**{r['wrong']}**" if r["wrong"] else "0"] for r in rows]))
                out.append("")
                out += self.caption(f"Run by `{a.command}` as", cmd)
                out.append("")
        return out
