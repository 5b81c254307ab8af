#!/usr/bin/env python3
"""The benchmark driver: runs every stage over a sweep of rank counts and configs with --json,
the micro-benchmarks and the projection, and writes docs/benchmarks.md (one section per device),
a CSV per device and SVG plots. Normally started by scripts/bench.sh, which builds first.

    tools/bench.py --build DIR [--device cpu|cuda] [--repeats R] [--quick] [--out DIR]
                   [--stages 04,05] [--ranks 2,4] [--model NAME | --config FILE]
                   [--work DIR] [--mpirun "mpirun --oversubscribe --bind-to none"]
                   [--command "what to print as the command that made the tables"]
    tools/bench.py --from-logs DIR [--from-logs DIR2 …] [--out DIR]

--from-logs DIR publishes a GPU run made elsewhere: the CUDA section, benchmarks/cuda_run.csv and
figures/bench_cuda_attention.svg written from the logs of a run folder (docs/gpu-runs/DATE-GPU,
as scripts/gpu-validate.sh and the profilers left them), parsed by tools/gpu_logs.py; nothing is
run, and a log that lacks a line the section needs stops it (exit 1, naming the file). Given
again (newest run first), the section keeps every run: a table of the runs side by side, then a
subsection per run, labelled with its GPU; an earlier run's CSV and figure carry its folder's
name (benchmarks/cuda_run.DATE-GPU.csv, figures/bench_cuda_attention.DATE-GPU.svg).

The sweep: N = 1, 2, 4 (stage 01 only at N = 1; an N that does not divide H, NH, F and S is left
out), the default config and a GEMM-dominated one, each point run R times. Stage 08 has its own
subsection (cp_plan): its meshes C × T = 2 × 1, 1 × 2, 2 × 2 at S = 128 and 512 beside stage 03 at
the same S and N, and attention time against S for C = 1, 2, 4 (T = 1), from the `attention fwd` /
`attention bwd` spans of every run's --trace (the same measure at every C; the stage's own
cp_attention_ms is 0 at C = 1, where stage 08 is stage 07) beside the ring steps alone. Stage 09
has its own subsection too (pp_plan): each schedule (gpipe, 1f1b, zb-h1 at V = 1,
interleaved-1f1b at V = 2) at P = 2 and 4 (N = P, T = D = C = 1) over M = 1, 2, 4, 8 on small
sizes, the --json's measured bubble beside the schedule's formula. A selection
narrows it: --stages (numbers or names, comma-separated), --ranks (comma-separated N), and --model
NAME or --config FILE, which replace the two configs by that one, forwarded as they are to every
stage and to tpx_project (a stage that refuses the config at some N, exit 2, leaves that point out
with its one line). With a selection the page goes under --work unless --out is given, so the
committed docs/benchmarks.md keeps the full sweep; its text says what ran either way. A point's step
time is the mean over the steps after step 0 (step 0 warms up) of one run; the tables give the
median over the R runs and their spread as min–max. From it, per rank:
    TFLOP/s        = flops_per_step_per_rank / step time            (GEMM FLOPs, common/flops.h)
    MFU            = TFLOP/s / peak, the peak MEASURED by bench_gemm (its largest bf16 GEMM on
                     cuda, fp32 on the cpu), never assumed
    comm bus GB/s  = comm_bus_bytes per step / step time             (10⁹ bytes per second)
    speed-up vs 03 = step time of stage 03 / step time of the stage  (same config and N)

Outputs under --out (default: the repository's docs/): benchmarks.md, whose sections between
`<!-- tpx-bench:begin NAME -->` and `<!-- tpx-bench:end NAME -->` are replaced one at a time
(a cpu run leaves the cuda section alone and vice versa; stage 08's subsection has its own
markers, `<device>-cp`, and --only cp replaces it alone; stage 09's likewise, `<device>-pp` and
--only pp), benchmarks/<device>.csv, benchmarks/<device>_cp.csv,
benchmarks/<device>_cp_attention.csv, benchmarks/<device>_pp.csv,
figures/bench_<device>_{step_ms,exposed_comm,breakdown}.svg,
figures/bench_<device>_cp_attention.svg and figures/bench_<device>_pp_bubble.svg. The raw --json
files and logs go under --work. A stage run that fails stops the driver (exit 1); a
micro-benchmark program that is missing or fails leaves a one-line note in its section instead
(collectives with wrong results are flagged in bold in the section and on stderr). Before it
exits the driver reads its outputs back and exits 1 if any expected file, row or cell is missing.

The environment is the caller's: under scripts/env.sh (OPENBLAS_NUM_THREADS=1, Open MPI's consent
to run as root and to oversubscribe). Plots need matplotlib (Debian: python3-matplotlib).
"""
import argparse
import csv
import datetime
import json
import math
import os
import pathlib
import re
import shlex
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
STAGES = ["01_baseline", "02_megatron_tp", "03_sequence_parallel", "04_overlap_ring",
          "05_copy_engine_async_tp", "06_fp8", "07_fsdp_tp", "08_context_parallel",
          "09_pipeline_parallel"]
# The mesh stages run at points (N, X) of their own dimension X, N = X · TP: stage 07 on D × TP
# (rows "07_fsdp_tp D<D>": 1 × 2, 2 × 1, 2 × 2), stage 08 on C × TP (rows
# "08_context_parallel C<C>": C × T = 2 × 1, 1 × 2, 2 × 2), each with its flag and json key.
MESH_STAGES = {"07_fsdp_tp": ("D", "--dp", "dp", [(2, 1), (2, 2), (4, 2)]),
               "08_context_parallel": ("C", "--cp", "cp", [(2, 2), (2, 1), (4, 2)])}


def stage_label(stage, degree=None):
    """A sweep row's stage: the executable, and for a mesh stage its own dimension's degree."""
    return f"{stage} {MESH_STAGES[stage][0]}{degree}" if stage in MESH_STAGES else stage


def split_label(label):
    """(executable, flag, degree) of a sweep row's stage; flag and degree None but on a mesh."""
    exe, _, rest = label.partition(" ")
    if exe in MESH_STAGES and rest:
        return exe, MESH_STAGES[exe][1], rest[1:]
    return exe, None, None
REFERENCE_STAGE = "03_sequence_parallel"  # the speed-up column's denominator
# Stage 08 has its own subsection (cp_plan): its meshes at two sequence lengths beside stage 03 at
# the same S and N, and attention time against S for C = 1, 2, 4 (T = 1), every run traced.
CP_STAGE = "08_context_parallel"
CP_TABLE_SEQS = {False: [128, 512], True: [128]}  # the stage table's S (quick: the default only)
CP_ATTENTION_SEQS = {False: [64, 128, 256, 512], True: [32, 64, 128]}
CP_ATTENTION_C = [1, 2, 4]
# Stage 09 has its own subsection (pp_plan): each schedule at P = 2 and 4 (T = D = C = 1) over a
# sweep of M, its measured bubble beside the schedule's formula. Small sizes: B divides by every
# M, L >= P·V at the largest P and V.
PP_STAGE = "09_pipeline_parallel"
PP_SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)]  # (name, V)
PP_DEGREES = [2, 4]
PP_MICROBATCHES = {False: [1, 2, 4, 8], True: [2, 4]}
PP_SIZES = {"hidden": 128, "heads": 4, "ffn": 512, "seq": 64, "batch": 8, "layers": 8}
# The stages with a subsection of their own, each between the markers `<device>-<name>`.
SUBSECTIONS = {"cp": CP_STAGE, "pp": PP_STAGE}
MIB = 1024.0 * 1024.0
SECTIONS = ["cpu", "cuda", "projection"]  # the order of the sections in benchmarks.md


class BenchError(Exception):
    """A failure that stops the driver: a stage run, bad input, an incomplete output."""


# ---------------------------------------------------------------------------------------------
# The arithmetic (tools/test_bench.py checks every function here on numbers worked by hand).


def steady_mean(steps, key):
    """Mean of steps[i][key] over the steps after step 0 (it warms up), or step 0 if alone."""
    if not steps:
        raise BenchError("a run recorded no steps")
    rows = steps[1:] if len(steps) > 1 else steps
    return sum(float(s[key]) for s in rows) / len(rows)


def median_spread(values):
    """(median, min, max) of the repeats' values."""
    if not values:
        raise BenchError("no values")
    return statistics.median(values), min(values), max(values)


def tflops_per_rank(flops_per_step_per_rank, step_ms):
    """TFLOP/s of one rank: its GEMM FLOPs per step over the step time."""
    return flops_per_step_per_rank / (step_ms * 1e-3) / 1e12


def mfu(tflops, peak_tflops):
    """Model FLOPs utilisation against a measured peak; None when no peak was measured."""
    if not peak_tflops:
        return None
    return tflops / peak_tflops


def bus_gbps(comm_bus_bytes, step_ms):
    """Bus bandwidth of one rank in GB/s (10⁹ B/s): its bus bytes per step over the step time."""
    return comm_bus_bytes / (step_ms * 1e-3) / 1e9


def speedup(reference_ms, step_ms):
    """How many times faster than the reference stage (stage 03) a stage's step is."""
    if reference_ms is None:
        return None
    return reference_ms / step_ms


def divides(config, n):
    """Whether N ranks can split the config: H, NH, F and S (sequence parallelism) by N."""
    return all(config[k] % n == 0 for k in ("hidden", "heads", "ffn", "seq"))


def cp_plan(ranks, quick, device="cpu"):
    """Stage 08's subsection as points: the stage table's (S, stage, N), stage 08 on its meshes
    C × T (MESH_STAGES) and stage 03 at every N as the speed-up's reference, and the attention
    sweep's (S, C), run at N = C (T = 1); only N in `ranks`, only S that 2·C·T divides. The
    attention sweep is the cpu's only: --cp > 1 has no CUDA kernels yet, and a trace span times
    the host, not a GPU's kernels."""
    table = []
    for seq in CP_TABLE_SEQS[quick]:
        z = {**DEFAULTS, "seq": seq}
        table += [(seq, REFERENCE_STAGE, n) for n in ranks if divides(z, n)]
        table += [(seq, stage_label(CP_STAGE, c), n) for n, c in MESH_STAGES[CP_STAGE][3]
                  if n in ranks and seq % (2 * n) == 0 and divides(z, n // c)]
    attention = [(seq, c) for seq in CP_ATTENTION_SEQS[quick] for c in CP_ATTENTION_C
                 if c in ranks and seq % (2 * c) == 0 and device == "cpu"]
    return table, attention


def pp_plan(ranks, quick):
    """Stage 09's subsection as points (schedule, P, V, M), run at N = P: every schedule of
    PP_SCHEDULES at each P of PP_DEGREES in `ranks`, over M of PP_MICROBATCHES that divide B
    (interleaved needs M % P == 0 too), with L >= P·V."""
    z = PP_SIZES
    return [(name, p, v, m) for name, v in PP_SCHEDULES for p in PP_DEGREES if p in ranks
            for m in PP_MICROBATCHES[quick]
            if z["batch"] % m == 0 and z["layers"] >= p * v and (v == 1 or m % p == 0)]


def summarise_pp(point, summaries):
    """One point of stage 09's sweep from its R runs' --json summaries: the measured bubble's
    median and spread, the formula's bubble (None where the schedule has none), the step time
    and pp bytes per step (each run's mean over steps 1 …, the median over the runs), and the
    peak count of live micro-batches per pipeline rank (the largest over the runs)."""
    schedule, p, v, m = point
    pipes = [s["pipeline"] for s in summaries]
    med, lo, hi = median_spread([float(x["bubble_measured"]) for x in pipes])
    formula = pipes[0].get("bubble_formula")
    live = [max(int(x["live_peak"][r]) for x in pipes) for r in range(len(pipes[0]["live_peak"]))]
    return {"schedule": schedule, "p": p, "v": v, "m": m, "n": int(summaries[0]["world_size"]),
            "repeats": len(summaries), "bubble": med, "bubble_min": lo, "bubble_max": hi,
            "formula": None if formula is None or not math.isfinite(float(formula))
            else float(formula),
            "step_ms": statistics.median(steady_mean(s["steps"], "ms") for s in summaries),
            "pp_bytes": statistics.median(steady_mean(s["steps"], "pp_bus_bytes")
                                          for s in summaries),
            "live_peak": " ".join(map(str, live))}


def left_out_list(lines):
    """The bullets under a table for the points a sweep left out, and a blank line after them."""
    return [f"- left out: {line}" for line in lines] + ([""] if lines else [])


def sweep_series(rows, line, x, y, more=()):
    """A plot's lines from a sweep's rows: {line(row): {x name: [...], y name: [median ...],
    "err": [[below ...], [above ...]] (to the y field's _min and _max), and a list per name of
    more}}, x ascending. x, y and each of more are (name in the series, field of the row)."""
    series = {}
    for r in sorted(rows, key=lambda r: (line(r), r[x[1]])):
        s = series.setdefault(line(r), {name: [] for name, _ in (x, y, *more)} | {"err": [[], []]})
        for name, field in (x, y, *more):
            s[name].append(r[field])
        s["err"][0].append(r[y[1]] - r[y[1] + "_min"])
        s["err"][1].append(r[y[1] + "_max"] - r[y[1]])
    return series


def pp_series(rows):
    """The plot's lines, from stage 09's rows: {(schedule, P): {"m": [M ...], "bubble": [median
    ...], "err": [[below ...], [above ...]] (to min and max), "formula": [...]}}, M ascending."""
    return sweep_series(rows, lambda r: (r["schedule"], r["p"]), ("m", "m"), ("bubble", "bubble"),
                        [("formula", "formula")])


def trace_lanes(events):
    """{(rank, lane name): tid} from a --trace file's thread_name records."""
    return {(e["pid"], e["args"]["name"]): e["tid"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}


ATTENTION_SPANS = ("attention fwd", "attention bwd")  # common/block.cc's, around the attention


def attention_ms_per_step(trace, blocks=False):
    """{rank: [ms of step 0, 1, ...]} from a --trace file (its JSON): per rank, the sum of the
    `attention fwd` and `attention bwd` spans on its compute lane (the block's whole attention:
    at C > 1 the ring steps inside them and the waits for K/V as well) within each step, a step
    running from the start of one `forward` span on the phases lane to the next one's. With
    `blocks`, the spans nested in those instead, stage 08's ring steps (`attention fwd ring step
    1/2 ...`, the spans its cp_attention_ms times too): the attention blocks alone."""
    events = trace["traceEvents"]
    lanes = trace_lanes(events)
    out = {}
    for rank in sorted({e["pid"] for e in events if e.get("ph") == "X"}):
        compute, phases = lanes.get((rank, "compute")), lanes.get((rank, "phases"))
        spans = [e for e in events if e.get("ph") == "X" and e["pid"] == rank]
        starts = sorted(e["ts"] for e in spans if e["tid"] == phases and e["name"] == "forward")
        if not starts:
            raise BenchError(f"the trace has no forward phase for rank {rank}")
        steps = [0.0] * len(starts)
        for e in spans:
            whole = e["name"] in ATTENTION_SPANS
            block = not whole and e["name"].startswith(ATTENTION_SPANS)
            if e["tid"] == compute and (block if blocks else whole):
                at = sum(1 for s in starts if s <= e["ts"]) - 1
                if at < 0:
                    raise BenchError(f"an attention span of rank {rank} before the first step")
                steps[at] += e["dur"] / 1e3
        out[rank] = steps
    return out


def attention_ms(trace, blocks=False):
    """A traced run's attention ms per step (attention_ms_per_step): each rank's mean over the
    steps after step 0 (as step times are taken), averaged over the ranks."""
    per_rank = attention_ms_per_step(trace, blocks)
    if not per_rank:
        raise BenchError("the trace has no spans")
    return statistics.mean(steady_mean([{"ms": ms} for ms in steps], "ms")
                           for steps in per_rank.values())


def summarise_attention(seq, c, runs):
    """One point of the attention sweep from its R runs' (summary, trace) pairs."""
    att = [attention_ms(trace) for _, trace in runs]
    med, lo, hi = median_spread(att)
    step = statistics.median(steady_mean(s["steps"], "ms") for s, _ in runs)
    blocks = statistics.median(attention_ms(t, True) for _, t in runs) if c > 1 else None
    rank0 = (statistics.median(steady_mean(s["steps"], "cp_attention_ms") for s, _ in runs)
             if c > 1 else None)
    return {"seq": seq, "c": c, "n": c, "t": 1, "repeats": len(runs),
            "attention_ms": med, "attention_ms_min": lo, "attention_ms_max": hi,
            "blocks_ms": blocks, "cp_attention_ms_rank0": rank0, "step_ms": step,
            "share": med / step}


def attention_series(rows):
    """The plot's lines, from the attention sweep's rows: {C: {"seq": [S ...], "ms": [median
    ...], "err": [[below ...], [above ...]] (to min and max), "blocks": [the ring steps' ms ...]
    (None at C = 1)}}, S ascending."""
    return sweep_series(rows, lambda r: r["c"], ("seq", "seq"), ("ms", "attention_ms"),
                        [("blocks", "blocks_ms")])


def summarise_point(summaries):
    """One sweep point (the --json summaries of its R runs) as the table's numbers, with the
    config's sizes and the device as the runs recorded them."""
    first = summaries[0]
    step_ms = [steady_mean(s["steps"], "ms") for s in summaries]
    med, lo, hi = median_spread(step_ms)
    exposed = statistics.median(steady_mean(s["steps"], "exposed_comm_ms") for s in summaries)
    bus = statistics.median(steady_mean(s["steps"], "comm_bus_bytes") for s in summaries)
    peak = statistics.median(max(float(r["peak_bytes"]) for r in s["steps"]) for s in summaries)
    tf = tflops_per_rank(float(first["flops_per_step_per_rank"]), med)
    key = MESH_STAGES[first["stage"]][2] if first["stage"] in MESH_STAGES else None
    return {"stage": stage_label(first["stage"], first.get(key)), "n": int(first["world_size"]),
            "device": first["config"]["device"], "dtype": first["config"]["dtype"],
            "step_ms": med, "step_ms_min": lo, "step_ms_max": hi, "repeats": len(summaries),
            "tflops": tf, "exposed_ms": exposed, "bus_bytes": bus, "bus_gbps": bus_gbps(bus, med),
            "peak_mib": peak / MIB, "saved_mib": float(first["saved_activation_bytes"]) / MIB,
            "device_description": first.get("device_description"),
            "device_name": first.get("device_name"),
            **{k: int(first["config"][k]) for k in SIZE_KEYS if k in first["config"]}}


def add_derived(rows, peak_tflops):
    """Fills in MFU and the speed-up against stage 03 at the same config and N."""
    ref = {(r["config"], r["n"]): r["step_ms"] for r in rows if r["stage"] == REFERENCE_STAGE}
    for r in rows:
        r["peak_tflops"] = peak_tflops
        r["mfu"] = mfu(r["tflops"], peak_tflops)
        r["speedup"] = speedup(ref.get((r["config"], r["n"])), r["step_ms"])


def benchmarks_md(md):
    """benchmarks.md as it stands (empty if new), with the current intro and a placeholder for
    every section it does not have yet."""
    text = replace_intro(md.read_text() if md.is_file() else "", INTRO)
    for name in SECTIONS:
        if f"<!-- tpx-bench:begin {name} -->" not in text:
            text = replace_section(text, name, PLACEHOLDER[name])
    return text


def replace_section(text, name, body):
    """text with the section NAME's body replaced (or added, in SECTIONS' order)."""
    begin, end = f"<!-- tpx-bench:begin {name} -->", f"<!-- tpx-bench:end {name} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text:
        if end not in text:
            raise BenchError(f"section '{name}' has a begin marker and no end marker")
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    # Before the first section that comes after it in SECTIONS' order, or at the end.
    for later in SECTIONS[SECTIONS.index(name) + 1:] if name in SECTIONS else []:
        marker = f"<!-- tpx-bench:begin {later} -->"
        if marker in text:
            head, rest = text.split(marker, 1)
            return head + block + "\n\n" + marker + rest
    return text.rstrip("\n") + "\n\n" + block + "\n"


def replace_intro(text, intro):
    """text with everything before its first section replaced by intro."""
    cut = text.find("<!-- tpx-bench:begin ")
    return intro.rstrip("\n") + "\n\n" + (text[cut:] if cut >= 0 else "")


# Columns of the stage table: (CSV name, markdown heading, formatter). Empty cells are errors
# unless the column says why it may be empty (see missing_cells).
def _f(digits):
    return lambda v: "—" if v is None else f"{v:.{digits}f}"


COLUMNS = [
    ("config", None, str),
    ("stage", "stage", str),
    ("n", "N", str),
    ("device", "device", str),
    ("dtype", "dtype", str),
    ("step_ms", "step ms (median)", _f(2)),
    ("spread", "spread (min–max)", str),
    ("tflops", "TFLOP/s per rank", _f(4)),
    ("mfu", "MFU per rank", lambda v: "—" if v is None else f"{100 * v:.1f} %"),
    ("exposed_ms", "exposed comm ms", _f(2)),
    ("bus_gbps", "comm bus GB/s", _f(3)),
    ("peak_mib", "peak MiB", _f(1)),
    ("saved_mib", "saved act MiB", _f(2)),
    ("speedup", "speed-up vs 03", lambda v: "—" if v is None else f"{v:.2f}×"),
]
CSV_FIELDS = ["config", "hidden", "heads", "ffn", "seq", "batch", "layers", "steps", "stage", "n",
              "device", "dtype", "repeats", "step_ms", "step_ms_min", "step_ms_max", "tflops",
              "peak_tflops", "mfu", "exposed_ms", "bus_bytes", "bus_gbps", "peak_mib", "saved_mib", "speedup"]
# Stage 08's subsection: its stage table (the mesh C × T besides), and the attention sweep.
CP_CSV_FIELDS = CSV_FIELDS + ["c", "t"]
PP_FIELDS = ["schedule", "p", "v", "m", "n", "repeats", "steps", "bubble", "bubble_min",
             "bubble_max", "formula", "step_ms", "pp_bytes", "live_peak"]
ATTENTION_FIELDS = ["seq", "c", "n", "t", "repeats", "steps", "attention_ms", "attention_ms_min",
                    "attention_ms_max", "blocks_ms", "cp_attention_ms_rank0", "step_ms", "share"]


def missing_cells(rows, expected, peak_measured, reference_ran):
    """Every problem with the table: expected (config, stage, N) points without a row, and empty
    or non-finite cells. MFU may be empty only without a measured peak, the speed-up only when
    stage 03 did not run."""
    problems = []
    have = {(r.get("config"), r.get("stage"), str(r.get("n"))): r for r in rows}
    for point in expected:
        if (point[0], point[1], str(point[2])) not in have:
            problems.append(f"no row for config {point[0]}, stage {point[1]}, N {point[2]}")
    for r in rows:
        where = f"{r.get('config')}/{r.get('stage')}/N={r.get('n')}"
        for field in CSV_FIELDS:
            v = r.get(field)
            if v in (None, "") or (isinstance(v, float) and not math.isfinite(v)):
                if field in ("mfu", "peak_tflops") and not peak_measured:
                    continue
                if field == "speedup" and not reference_ran:
                    continue
                problems.append(f"{where}: no {field}")
            elif isinstance(v, str) and v.lower() in ("nan", "inf", "-inf"):
                problems.append(f"{where}: {field} is {v}")
    return problems


# ---------------------------------------------------------------------------------------------
# Running programs.


def rel(path):
    """A path as the repository root sees it, for the commands the tables print."""
    try:
        return str(pathlib.Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def run(cmd, log, timeout):
    """Runs cmd with its output into log; returns (exit status, last line of output)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout)
        out, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (
            e.stdout or "")
        out += f"\n(killed after {timeout} s)"
        rc = 124
    except OSError as e:
        out, rc = str(e), 127
    log.write_text(out)
    # The program's own last error line, not mpirun's boilerplate about it.
    lines = [ln.strip() for ln in out.splitlines()
             if ln.strip() and not re.fullmatch(r"-+", ln.strip())]
    lines = [ln for ln in lines if not re.search(r"mpirun|Primary job|non-zero|Process name|"
                                                 r"Exit code|Per user-direction", ln)]
    errors = [ln for ln in lines if re.search(r"error|wrong|fail|killed", ln, re.I)]
    return rc, (errors[-1] if errors else lines[-1] if lines else f"exit status {rc}")


def trace_path(json_path):
    """Where a run's --trace goes: beside its --json, X.json -> X.trace.json."""
    return json_path.parent / (json_path.name.removesuffix(".json") + ".trace.json")


def config_flags(config):
    """The flags that give a stage the config: its sizes, or --model / --config as given."""
    flags = list(config.get("flags", []))
    for key in ("hidden", "heads", "ffn", "seq", "batch", "layers"):
        if key in config.get("set", {}):
            flags += [f"--{key}", str(config["set"][key])]
    return flags


def configs_for(device, quick, model=None, config_file=None):
    """The sweep's configs: the default and a GEMM-dominated one (H and F large against S), or
    the one --model / --config names (its sizes are the stage's to resolve: "flags")."""
    if model:
        return [{"name": model, "set": {}, "flags": ["--model", model], "optional": False,
                 "why": f"the `--model {model}` preset"}]
    if config_file:
        return [{"name": pathlib.Path(config_file).stem, "set": {},
                 "flags": ["--config", str(config_file)], "optional": False,
                 "why": f"the config file `{config_file}`"}]
    default = {"name": "default", "set": {}, "optional": False,
               "why": "the tutorial's default config"}
    if device == "cpu":
        big = [{"name": "gemm-heavy", "optional": False,
                "set": {"hidden": 512, "heads": 8, "ffn": 2048, "seq": 64, "batch": 2,
                        "layers": 1},
                "why": "H and F large against S: the GEMMs dominate the step"}]
    else:
        big = [{"name": "llama-7b", "optional": False,
                "set": {"hidden": 4096, "heads": 32, "ffn": 11008, "seq": 2048, "batch": 1,
                        "layers": 1},
                "why": "a Llama-7B-sized layer: the GEMMs dominate the step"},
               {"name": "llama-70b", "optional": True,
                "set": {"hidden": 8192, "heads": 64, "ffn": 28672, "seq": 2048, "batch": 1,
                        "layers": 1},
                "why": "a Llama-3-70B-sized layer (run where its memory fits)"}]
    return [default] if quick else [default] + big


DEFAULTS = {"hidden": 256, "heads": 8, "ffn": 1024, "seq": 128, "batch": 2, "layers": 2}
SIZE_KEYS = list(DEFAULTS)


def sizes(config):
    return {**DEFAULTS, **config["set"]}


def size_text(s):
    return (f"H={s['hidden']} NH={s['heads']} F={s['ffn']} S={s['seq']} B={s['batch']} "
            f"L={s['layers']}")


class Driver:
    def __init__(self, a):
        self.a = a
        self.build = pathlib.Path(a.build)
        self.bin = self.build / "bin"
        self.out = pathlib.Path(a.out)
        self.work = pathlib.Path(a.work) / a.device
        self.mpirun = shlex.split(a.mpirun)
        self.date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        self.steps = 3 if a.quick else 8
        self.ranks = a.ranks or ([1, 2] if a.quick else [1, 2, 4])
        self.repeats = 1 if a.quick else a.repeats
        self.configs = configs_for(a.device, a.quick, a.model, a.config)
        self.notes = []  # lines for the section's notes

    def exe(self, name):
        p = self.bin / name
        return p if p.is_file() and os.access(p, os.X_OK) else None

    def stage_cmd(self, stage, n, config, json_path):
        exe, flag, degree = split_label(stage)  # "07_fsdp_tp D2": the mesh stage at D = 2
        cmd = self.mpirun + ["-np", str(n), str(self.bin / exe), "--device", self.a.device,
                             "--steps", str(self.steps)] + config_flags(config)
        if flag:
            cmd += [flag, degree]
        if self.a.device == "cuda" and stage != "06_fp8":
            cmd += ["--dtype", "bf16"]  # 06 keeps its default, fp8
        return cmd + ["--json", str(json_path)]

    # -- the stage sweep ----------------------------------------------------------------------
    def sweep(self, chosen):
        """The stage tables: the stages `chosen` (stage 08 has its own sweep, cp_sweep)."""
        stages = [s for s in chosen if self.exe(s)]
        if not stages:
            raise BenchError(f"no stage executables in {self.bin} (build first: scripts/bench.sh)")
        if self.a.stages and len(stages) < len(chosen):
            missing = [s for s in chosen if s not in stages]
            raise BenchError(f"not built in {self.bin}: {', '.join(missing)}")
        points, skipped = [], []
        for config in self.configs:
            known = "flags" not in config  # a preset's sizes are the stage's to check
            for stage in stages:
                if stage in MESH_STAGES:
                    letter, _, _, mesh_points = MESH_STAGES[stage]
                    for n, x in mesh_points:
                        if n not in self.ranks:
                            continue
                        z = sizes(config)
                        # D splits the batch; C cuts the sequence into 2C chunks split over TP.
                        bad = (z["batch"] % x if letter == "D"
                               else z["seq"] % (2 * n) or z["heads"] % (n // x))
                        if known and (not divides(z, n // x) or bad):
                            skipped.append(f"{config['name']} at {letter} {x} × TP {n // x}: "
                                           f"{size_text(z)} does not split")
                            continue
                        points.append((config, stage_label(stage, x), n))
                    continue
                for n in self.ranks:
                    if stage == "01_baseline" and n > 1:
                        continue
                    if known and not divides(sizes(config), n):
                        skipped.append(f"{config['name']} at N={n}: {size_text(sizes(config))} "
                                       f"does not split by {n}")
                        continue
                    points.append((config, stage, n))
        results = {}  # (config name, stage, n) -> [summaries]
        refused = {}  # optional config name -> the stage's one-line refusal
        declined = set()  # (config, stage, n) a stage refused under --model / --config
        total = len(points) * self.repeats
        done = 0
        for rep in range(self.repeats):  # repeats outermost: drift spreads over every point
            for config, stage, n in points:
                done += 1
                if config["name"] in refused:
                    continue
                name = stage.replace(" ", "-")  # "07_fsdp_tp-D2"
                path = self.work / "runs" / f"{config['name']}.{name}.np{n}.r{rep}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                cmd = self.stage_cmd(stage, n, config, path)
                print(f"[{done}/{total}] {config['name']} {stage} N={n} (repeat {rep + 1})",
                      flush=True)
                rc, last = run(cmd, path.with_suffix(".log"), self.a.timeout)
                if rc == 2 and config["optional"]:  # e.g. the memory estimate does not fit
                    refused[config["name"]] = f"{stage} at N={n}: {last}"
                    continue
                if rc == 2 and "flags" in config:  # the stage refuses the preset at this N
                    if (config["name"], stage, n) not in declined:
                        declined.add((config["name"], stage, n))
                        skipped.append(f"{config['name']} {stage} at N={n}: {last}")
                    continue
                if rc != 0:
                    raise BenchError(f"stage run failed (exit {rc}): {shlex.join(cmd)}\n  {last}\n"
                                     f"  full output: {path.with_suffix('.log')}")
                results.setdefault((config["name"], stage, n), []).append(
                    json.loads(path.read_text()))
        rows = []
        labels = [lab for s in stages
                  for lab in ([stage_label(s, x) for x in sorted({x for _, x in MESH_STAGES[s][3]})]
                              if s in MESH_STAGES else [s])]
        for config in self.configs:
            if config["name"] in refused:
                continue
            for stage in labels:
                for n in self.ranks:
                    runs = results.get((config["name"], stage, n))
                    if not runs:
                        continue
                    r = summarise_point(runs)
                    r.update(config=config["name"], steps=self.steps)
                    r["spread"] = f"{r['step_ms_min']:.2f}–{r['step_ms_max']:.2f}"
                    rows.append(r)
        expected = [(c["name"], s, n) for c, s, n in points
                    if c["name"] not in refused and (c["name"], s, n) not in declined]
        return stages, rows, expected, skipped, refused

    def cp_config(self, seq):
        return {"name": f"S{seq}", "set": {"seq": seq}, "optional": False,
                "why": ("the tutorial's default config" if seq == DEFAULTS["seq"] else
                        f"the default config with a {seq // DEFAULTS['seq']}× longer sequence")}

    def cp_sweep(self):
        """Stage 08's subsection (cp_plan), every run with --trace; a point whose stage refuses
        it (exit 2, e.g. --cp > 1 on cuda) is left out with its line. Returns (table rows,
        attention rows, expected table points, expected attention points, left-out lines)."""
        missing = [s for s in (REFERENCE_STAGE, CP_STAGE) if not self.exe(s)]
        if missing:
            raise BenchError(f"not built in {self.bin}: {', '.join(missing)}")
        table, attention = cp_plan(self.ranks, self.a.quick, self.a.device)
        runs = list(dict.fromkeys(table + [(seq, stage_label(CP_STAGE, c), c)
                                           for seq, c in attention]))

        def command(point, json_path):
            seq, stage, n = point
            return (self.stage_cmd(stage, n, self.cp_config(seq), json_path) +
                    ["--trace", str(trace_path(json_path))])

        results, refused = self.run_points(
            "cp", runs, lambda pt: f"S{pt[0]}.{pt[1].replace(' ', '-')}.np{pt[2]}",
            lambda pt: f"S={pt[0]} {pt[1]} N={pt[2]}", command, traced=True)
        rows = []
        for seq, stage, n in table:
            if (seq, stage, n) not in results:
                continue
            r = summarise_point([s for s, _ in results[(seq, stage, n)]])
            _, _, degree = split_label(stage)
            c = int(degree) if degree else 1  # stage 03: no CP, T = N
            r.update(config=f"S{seq}", steps=self.steps, c=c, t=n // c,
                     spread=f"{r['step_ms_min']:.2f}–{r['step_ms_max']:.2f}")
            rows.append(r)
        att = [summarise_attention(seq, c, results[(seq, stage_label(CP_STAGE, c), c)])
               for seq, c in attention if (seq, stage_label(CP_STAGE, c), c) in results]
        for r in att:
            r["steps"] = self.steps
        left_out = [f"S={seq} {stage} at N={n}: {line}"
                    for (seq, stage, n), line in refused.items()]
        return (rows, att, [(f"S{s}", st, n) for s, st, n in table if (s, st, n) not in refused],
                [(s, c) for s, c in attention if (s, stage_label(CP_STAGE, c), c) not in refused],
                left_out)

    def run_points(self, part, points, name, title, command, traced=False):
        """Runs a subsection's points R times, repeats outermost (drift spreads over every
        point), each with --json (and, `traced`, --trace beside it) under WORK/<part>/; a point
        whose stage refuses it (exit 2) is left out after its first refusal, any other failure
        stops the driver. name(point): the files' name, title(point): the progress line's,
        command(point, json path): the command. Returns ({point: [(summary, trace or None) per
        run]}, {point: its one-line refusal})."""
        results, refused = {}, {}
        total, done = len(points) * self.repeats, 0
        for rep in range(self.repeats):
            for point in points:
                done += 1
                if point in refused:
                    continue
                base = self.work / part / f"{name(point)}.r{rep}"
                base.parent.mkdir(parents=True, exist_ok=True)
                json_path = base.parent / (base.name + ".json")
                cmd = command(point, json_path)
                print(f"[{part} {done}/{total}] {title(point)} (repeat {rep + 1})", flush=True)
                log = base.parent / (base.name + ".log")
                rc, last = run(cmd, log, self.a.timeout)
                if rc == 2:
                    refused[point] = last
                    continue
                if rc != 0:
                    raise BenchError(f"stage run failed (exit {rc}): {shlex.join(cmd)}\n  {last}\n"
                                     f"  full output: {log}")
                trace = json.loads(trace_path(json_path).read_text()) if traced else None
                results.setdefault(point, []).append((json.loads(json_path.read_text()), trace))
        return results, refused

    def pp_config(self):
        return {"name": "pp", "set": PP_SIZES, "optional": False,
                "why": "small sizes: the pipeline's mechanics in seconds per run"}

    def pp_cmd(self, point, json_path):
        """A point of stage 09's sweep: N = P ranks, T = D = C = 1."""
        schedule, p, v, m = point
        return self.stage_cmd(PP_STAGE, p, self.pp_config(), json_path) + [
            "--pp", str(p), "--schedule", schedule, "--stages-per-rank", str(v),
            "--microbatches", str(m)]

    def pp_sweep(self):
        """Stage 09's subsection (pp_plan); a point the stage refuses (exit 2) is left out with
        its line. Returns (rows, expected points, left-out lines)."""
        if not self.exe(PP_STAGE):
            raise BenchError(f"not built in {self.bin}: {PP_STAGE}")
        points = pp_plan(self.ranks, self.a.quick)
        if not points:
            raise BenchError(f"{PP_STAGE}'s sweep runs at N = P = "
                             f"{' or '.join(map(str, PP_DEGREES))}: --ranks has neither")
        results, refused = self.run_points(
            "pp", points, lambda pt: f"{pt[0]}.P{pt[1]}.V{pt[2]}.M{pt[3]}",
            lambda pt: f"{pt[0]} P={pt[1]} V={pt[2]} M={pt[3]}", self.pp_cmd)
        rows = [dict(summarise_pp(pt, [s for s, _ in results[pt]]), steps=self.steps)
                for pt in points if pt in results]
        left_out = [f"{s} P={p} V={v} M={m}: {line}" for (s, p, v, m), line in refused.items()]
        return rows, [pt for pt in points if pt not in refused], left_out

    # -- micro-benchmarks ---------------------------------------------------------------------
    def bench_gemm(self):
        """Runs bench_gemm; returns (rows, chunked rows, the command, a note if it could not)."""
        exe = self.exe("bench_gemm")
        if not exe:
            return None, None, None, f"`bench_gemm` is not in {rel(self.bin)} (not built)."
        path = self.work / "bench_gemm.json"
        cmd = [str(exe), f"--benchmark_filter=^gemm(_chunked)?/{self.a.device}/",
               f"--benchmark_out={path}", "--benchmark_out_format=json"]
        if self.a.device == "cpu":  # Google Benchmark's default of 0.5 s per row is not needed
            cmd.append(f"--benchmark_min_time={0.01 if self.a.quick else 0.2}")
        print("bench_gemm ...", flush=True)
        rc, last = run(cmd, path.with_suffix(".log"), self.a.timeout)
        if rc != 0 or not path.is_file():
            return None, None, cmd, f"`bench_gemm` failed (exit {rc}): {last}"
        gemm, chunked = parse_gemm(json.loads(path.read_text()), self.a.device)
        return gemm, chunked, cmd, None

    def bench_collectives(self):
        """Runs bench_collectives at N = 2 (and 4); returns [(n, rows, cmd, note)]."""
        exe = self.exe("bench_collectives")
        if not exe:
            return [(None, None, None, f"`bench_collectives` is not in {rel(self.bin)} "
                     "(not built).")]
        max_bytes = "64K" if self.a.quick else ("16M" if self.a.device == "cpu" else "1G")
        out = []
        for n in [2] if self.a.quick else [2, 4]:
            path = self.work / f"bench_collectives.np{n}.json"
            path.unlink(missing_ok=True)
            cmd = self.mpirun + ["-np", str(n), str(exe), "--max-bytes", max_bytes,
                                 f"--benchmark_filter=^collective/[^/]+/{self.a.device}/",
                                 f"--benchmark_out={path}", "--benchmark_out_format=json"]
            print(f"bench_collectives N={n} ...", flush=True)
            rc, last = run(cmd, path.with_suffix(".log"), self.a.timeout)
            rows = None
            if path.is_file():
                try:
                    rows = parse_collectives(json.loads(path.read_text()))
                except (ValueError, KeyError) as e:
                    last = f"unreadable output: {e}"
            note = None if rc == 0 else f"`bench_collectives` at N={n} failed (exit {rc}): {last}"
            out.append((n, rows, cmd, note))
        return out

    def projection(self):
        """Runs tpx_project; returns (its markdown, the command, a note if it could not)."""
        exe = self.exe("tpx_project")
        if not exe:
            return None, None, f"`tpx_project` is not in {rel(self.bin)} (not built)."
        md, js = self.work / "projection.md", self.work / "projection.json"
        md.unlink(missing_ok=True)
        cmd = [str(exe), "--device", str(ROOT / "tools/devices/h100_sxm.json"), "--markdown",
               str(md), "--json", str(js)] + self.configs[0].get("flags", [])
        print("tpx_project ...", flush=True)
        rc, last = run(cmd, self.work / "projection.log", self.a.timeout)
        if rc != 0 or not md.is_file():
            return None, cmd, f"`tpx_project` failed (exit {rc}): {last}"
        return md.read_text(), cmd, None


def bench_name(b):
    """A Google Benchmark row's name without the suffixes the library appends."""
    parts = b["name"].split("/")
    while parts and re.fullmatch(r"(real|manual|process)_time|threads:\d+|repeats:\d+|"
                                 r"min_time:.*|iterations:\d+", parts[-1]):
        parts.pop()
    return parts


def to_us(b):
    scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[b.get("time_unit", "ns")]
    return float(b["real_time"]) * scale


def parse_gemm(j, device):
    """bench_gemm's JSON: the gemm/<device>/<dtype>/<layer>/<product> rows and the
    gemm_chunked/<device>/<dtype>/<gemm>/N:<n> rows."""
    gemm, chunked = [], []
    for b in j.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration":
            continue
        parts = bench_name(b)
        if len(parts) >= 5 and parts[0] == "gemm" and parts[1] == device:
            dims = dict(re.findall(r"([mnk])=(\d+)", b.get("label", "")))
            for k in "mnk":
                if k not in dims and k in b:
                    dims[k] = int(b[k])
            gemm.append({"dtype": parts[2], "gemm": "/".join(parts[3:]),
                         "m": int(dims.get("m", 0)), "n": int(dims.get("n", 0)),
                         "k": int(dims.get("k", 0)), "us": to_us(b),
                         "tflops": float(b.get("TFLOP/s", "nan"))})
        elif len(parts) >= 5 and parts[0] == "gemm_chunked" and parts[1] == device:
            n = parts[-1].split(":", 1)[-1]
            chunked.append({"dtype": parts[2], "gemm": "/".join(parts[3:-1]), "n": int(n),
                            "efficiency": float(b.get("efficiency", "nan")),
                            "tflops": float(b.get("TFLOP/s", "nan"))})
    return gemm, chunked


def measured_peak(gemm, device):
    """The peak MFU is measured against: the TFLOP/s of bench_gemm's largest GEMM in bf16 (cuda)
    or fp32 (cpu), the fastest of the largest if several share the size. None without one."""
    dtype = "bf16" if device == "cuda" else "fp32"
    rows = [g for g in gemm or [] if g["dtype"] == dtype and g["m"] * g["n"] * g["k"] > 0
            and math.isfinite(g["tflops"]) and g["tflops"] > 0]
    if not rows:
        return None
    size = max(g["m"] * g["n"] * g["k"] for g in rows)
    return max((g for g in rows if g["m"] * g["n"] * g["k"] == size), key=lambda g: g["tflops"])


def parse_collectives(j):
    """bench_collectives' JSON: {op: [rows sorted by size]}."""
    ops = {}
    for b in j.get("benchmarks", []):
        if b.get("run_type", "iteration") != "iteration":
            continue
        parts = bench_name(b)
        if len(parts) < 4 or parts[0] != "collective":
            continue
        us = float(b["time_us"]) if "time_us" in b else to_us(b)
        ops.setdefault(parts[1], []).append({
            "bytes": int(float(b["bytes"])), "count": int(float(b["count"])), "us": us,
            "algbw": float(b["algbw_GBps"]), "busbw": float(b["busbw_GBps"]),
            "wrong": int(float(b["wrong"])), "ranks": int(float(b.get("ranks", 0)))})
    for rows in ops.values():
        rows.sort(key=lambda r: r["bytes"])
    return ops


def size_label(n):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


# ---------------------------------------------------------------------------------------------
# Rendering.


def load_average():
    """The 1-minute load average (other work on the machine widens the spread), or None."""
    try:
        return float(pathlib.Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def md_table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def device_description(device, rows):
    """The device as the stages' --json name it (device_description, the string tpx_report's CSV
    carries too); read from this machine when no summary has it."""
    named = sorted({r.get("device_description") for r in rows if r.get("device_description")})
    if named:
        return "; ".join(named)
    if device == "cuda":
        names = {r.get("device_name") for r in rows if r.get("device_name")}
        name = sorted(names)[0] if names else "GPU (unnamed)"
        return f"cuda: {name}"
    model, ident = "unknown cpu", {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model == "unknown cpu":
                model = value.strip()
            elif key in ("cpu family", "model", "stepping") and key not in ident:
                ident[key] = value.strip()
            elif not line.strip() and ident:
                break
    except OSError:
        pass
    if ident:  # a virtual machine may name only the vendor: the family / model say which CPU
        model += " (" + ", ".join(f"{k} {v}" for k, v in ident.items()) + ")"
    return f"cpu: {model}, {os.cpu_count()} cores"


INTRO = """# Benchmarks

What each section is:

- **CPU** and **CUDA**: the stages run under `mpirun` with `--json` over several rank counts and
  configs, each point repeated (each section says which, written from what ran); then the
  micro-benchmarks on the same device: GEMM throughput at the block's shapes, the chunked GEMMs
  of the ring stages (efficiency against N), and the collectives in nccl-tests' convention.
  Stage 08 has a subsection of its own: its meshes at two sequence lengths beside stage 03, and
  its attention time against S for C = 1, 2, 4. Stage 09 has one too: each pipeline schedule at
  P = 2 and 4 over the number of micro-batches M, its measured bubble against the schedule's
  formula. A CPU section shows the mechanics (bytes, the structure of the overlap, relative
  cost), not GPU speed.
- **Projection**: the step time of each stage on N H100 SXM GPUs from the projection model
  (`tools/projection.h`), and of a Llama-3-70B-shaped stack on 4-D meshes (PP × DP × CP × TP) of
  64 and 512 GPUs; projected, not measured; then the model against published results,
  held-out cases first, and how far each error moves with each assumption.

Regenerate with `scripts/bench.sh` (CPU section and projection) or `scripts/bench.sh --device
cuda` on a GPU machine (CUDA section and projection); each run replaces only its own sections.
`scripts/bench.sh --from-logs docs/gpu-runs/DATE-GPU` publishes a GPU run made elsewhere: it
writes the CUDA section from that folder's logs (runs nothing; every number names its log);
`--from-logs` given again keeps several runs, newest first, each labelled with its GPU.
`scripts/bench.sh --stages 04,05 --ranks 2,4 [--model NAME | --config FILE]` runs a selection
(into `out/bench/` unless `--out` is given).
`tools/bench.py --only projection --build DIR` replaces the projection alone (no stage runs).
`tools/bench.py --only text` rewrites this text and each section's line of what ran, from the
section's CSV (runs nothing). `scripts/bench.sh --only cp` reruns only stage 08's
subsection of its device's section (with its own date, command and load average);
`scripts/bench.sh --only pp` likewise stage 09's.
No number in this file is typed by hand: all of it is written by `tools/bench.py`."""

PLACEHOLDER = {
    "cpu": "## CPU\n\nNot generated yet: `scripts/bench.sh` writes this section.",
    "cuda": "## CUDA\n\nNot generated yet: `scripts/bench.sh --device cuda` on a GPU machine, "
            "or `scripts/bench.sh --from-logs DIR` from a GPU run's logs, writes this section.",
    "projection": "## Projection (H100 SXM, projected)\n\nNot generated yet: `scripts/bench.sh` "
                  "writes this section.",
}


def mesh_points_of(rows):
    """{mesh stage: its (N, degree) points} for the mesh stages the rows have."""
    points = {}
    for r in rows:
        exe, _, degree = split_label(r["stage"])
        if degree is not None:
            points.setdefault(exe, set()).add((int(r["n"]), int(degree)))
    return {exe: sorted(p) for exe, p in points.items()}


def ran_text(stages, ranks, configs, repeats, steps, quick, mesh_points=None):
    """The sentence that says what the section's sweep ran, from the sweep itself (each mesh
    stage's points: `mesh_points`, else every point of MESH_STAGES within `ranks`)."""
    names = [f"`{s}`" for s in stages]
    listed = (names[0] if len(names) == 1 else
              f"{', '.join(names[:-1])} and {names[-1]}")
    meshes = []
    for stage in stages:
        if stage not in MESH_STAGES:
            continue
        letter, _, _, default = MESH_STAGES[stage]
        chosen = mesh_points.get(stage, []) if mesh_points is not None else default
        points = [f"{letter} {x} × TP {n // x}" for n, x in chosen if n in ranks]
        if points:
            meshes.append(f"`{stage}` on the meshes {', '.join(points)}")
    mesh = f" ({'; '.join(meshes)})" if meshes else ""
    cfgs = ", ".join(f"`{c['name']}`" for c in configs)
    return (f"{'Quick mode. ' if quick else ''}Ran {listed} over N = "
            f"{', '.join(map(str, ranks))}{mesh}; config{'s' if len(configs) > 1 else ''} {cfgs}; "
            f"{repeats} repeat{'s' if repeats > 1 else ''} of {steps} steps per point.")


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
                   f"{size_text(PP_SIZES)}, small so that a run takes seconds; {d.repeats} "
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


def fenced(cmd):
    """A command as a fenced shell block (markdown lines)."""
    return ["```sh", show(cmd), "```"]


def show(cmd):
    """A command as the tables print it: paths inside the repository relative to it, quoted for
    the shell where needed (placeholders such as <N> as they are)."""
    out = []
    for c in cmd:
        m = re.match(r"^(--[\w-]+=)?(/.*)$", c)
        c = (m.group(1) or "") + rel(m.group(2)) if m else c
        out.append(shlex.quote(c) if re.search(r"[^\w@%+=:,./<>-]", c) else c)
    return " ".join(out)


def pyplot(figures):
    """matplotlib's pyplot set up for the SVGs: deterministic (fixed hash salt, and no date when
    saved with metadata={"Date": None}) so re-running does not churn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams["svg.hashsalt"] = "tpx-bench"
    plt.rcParams["font.size"] = 9
    figures.mkdir(parents=True, exist_ok=True)
    return plt


def cpu_note(device):
    return "\ncpu backend: the mechanics, not GPU speed" if device == "cpu" else ""


def plot_cp_attention(rows, device, figures):
    """figures/bench_<device>_cp_attention.svg: attention ms per step against S, a line per C,
    from the attention sweep's rows (attention_series), error bars min–max over the runs; dashed,
    the ring steps' own time where C > 1."""
    plt = pyplot(figures)
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    handles = []  # the legend in C's order, each C's spans before its blocks
    for k, (c, s) in enumerate(sorted(attention_series(rows).items())):
        handles.append(ax.errorbar(s["seq"], s["ms"], yerr=s["err"], marker="o", capsize=3,
                                   color=colors(k),
                                   label=f"C = {c} (N = {c}, T = 1): attention spans"))
        if None not in s["blocks"]:
            handles += ax.plot(s["seq"], s["blocks"], marker="x", linestyle="--", color=colors(k),
                               label=f"C = {c}: its ring steps alone")
    seqs = sorted({r["seq"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seqs, [str(s) for s in seqs])
    ax.minorticks_off()
    # Plain numbers at 1, 2, 5 × 10^k across the drawn range, not only the decades.
    low, high = ax.get_ylim()
    ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(low)),
                                          math.ceil(math.log10(high)) + 1) for m in (1, 2, 5)]
    ticks = [v for v in ticks if low <= v <= high]
    ax.set_yticks(ticks, [f"{v:g}" for v in ticks])
    ax.set_ylim(low, high)
    ax.set_xlabel("S (tokens of the whole sequence)")
    ax.set_ylabel("attention ms per step on one rank (median)")
    ax.grid(True, alpha=0.3)
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(f"{device}: stage 08's attention time against S (ring){cpu_note(device)}")
    fig.tight_layout(rect=(0, 0.06 * ((len(handles) + 1) // 2), 1, 1))
    path = figures / f"bench_{device}_cp_attention.svg"
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return path


def plot_pp_bubble(rows, device, figures):
    """figures/bench_<device>_pp_bubble.svg: stage 09's measured bubble against M, a panel per P
    and a colour per schedule, from its rows (pp_series): the median with error bars min–max over
    the runs, and dashed the schedule's formula (where it has one) in the same colour; schedules
    whose formulas are the same line (GPipe's and 1F1B's) share one, named after both."""
    plt = pyplot(figures)
    colors = plt.get_cmap("tab10")
    series = pp_series(rows)
    degrees = sorted({p for _, p in series})
    names = [s for s, _ in PP_SCHEDULES if any(k[0] == s for k in series)]
    names += sorted({s for s, _ in series} - set(names))
    fig, axes = plt.subplots(1, len(degrees), figsize=(max(5.0 * len(degrees), 6.4), 5.4),
                             squeeze=False, sharey=True)
    legend = {}  # label -> handle, in the order drawn: per schedule, measured then formula
    for ax, p in zip(axes[0], degrees):
        formulas = {}  # the formula's points -> the schedules drawn with them, in this panel
        for k, name in enumerate(names):
            s = series.get((name, p))
            if not s:
                continue
            v = next((v for n, v in PP_SCHEDULES if n == name), 1)
            label = f"{name}{f' (V = {v})' if v > 1 else ''}: measured (CPU timings)"
            legend.setdefault(label, ax.errorbar(s["m"], s["bubble"], yerr=s["err"], marker="o",
                                                 capsize=3, color=colors(k), label=label))
            drawn = tuple((m, f) for m, f in zip(s["m"], s["formula"]) if f is not None)
            if not drawn:
                continue
            if drawn in formulas:
                formulas[drawn].append(name)
                continue
            formulas[drawn] = [name]
            formulas[drawn].append(ax.plot([m for m, _ in drawn], [f for _, f in drawn],
                                           linestyle="--", marker="x", color=colors(k))[0])
        for names_and_line in formulas.values():
            line, same = names_and_line[1], [names_and_line[0]] + names_and_line[2:]
            label = f"{' and '.join(same)}: formula"
            line.set_label(label)
            legend.setdefault(label, line)
        ms = sorted({m for (_, q), s in series.items() if q == p for m in s["m"]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.minorticks_off()
        ax.set_ylim(0, 1)
        ax.set_xlabel("M (micro-batches)")
        ax.set_title(f"P = {p} (N = {p} ranks)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("bubble: idle / wall over the pipeline's ranks")
    # One legend below the panels, a schedule's measured line above its formula.
    order = sorted(legend, key=lambda lab: (next((i for i, n in enumerate(names)
                                                  if lab.startswith(n)), len(names)),
                                            "formula" in lab))
    fig.legend([legend[lab] for lab in order], order, loc="lower center", ncol=2, fontsize=8,
               frameon=False)
    fig.suptitle(f"{device}: stage 09's bubble against M, measured and by the formula"
                 f"{cpu_note(device)}")
    fig.tight_layout(rect=(0, 0.045 * ((len(order) + 1) // 2), 1, 1))
    path = figures / f"bench_{device}_pp_bubble.svg"
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return path


def plot(rows, device, stages, figures):
    """The three SVGs of the stage tables."""
    plt = pyplot(figures)
    configs = []
    for r in rows:
        if r["config"] not in configs:
            configs.append(r["config"])
    colors = plt.get_cmap("tab10")
    note = cpu_note(device)
    paths = []

    def panels(title):
        fig, axes = plt.subplots(1, len(configs), figsize=(max(5.2 * len(configs), 6.4), 5.0),
                                 squeeze=False)
        fig.suptitle(title + note)
        return fig, axes[0]

    def save(fig, name, axes):
        # One legend for the panels, below them.
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8,
                   frameon=False)
        fig.tight_layout(rect=(0, 0.06 * ((len(labels) + 2) // 3), 1, 1))
        path = figures / f"bench_{device}_{name}.svg"
        fig.savefig(path, format="svg", metadata={"Date": None})
        plt.close(fig)
        paths.append(path)

    def lines(key, ylabel, name, title, bars):
        fig, axes = panels(title)
        for ax, config in zip(axes, configs):
            ns_all = sorted({r["n"] for r in rows if r["config"] == config})
            for k, stage in enumerate(stages):
                pts = sorted((r for r in rows if r["config"] == config and r["stage"] == stage),
                             key=lambda r: r["n"])
                if not pts:
                    continue
                x = [r["n"] for r in pts]
                y = [r[key] for r in pts]
                if bars:
                    err = [[r[key] - r["step_ms_min"] for r in pts],
                           [r["step_ms_max"] - r[key] for r in pts]]
                    ax.errorbar(x, y, yerr=err, marker="o", capsize=3, color=colors(k),
                                label=stage)
                else:
                    ax.plot(x, y, marker="o", color=colors(k), label=stage)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns_all, [str(n) for n in ns_all])
            ax.minorticks_off()
            ax.set_xlabel("N (ranks)")
            ax.set_ylabel(ylabel)
            ax.set_title(config)
            ax.grid(True, alpha=0.3)
        save(fig, name, axes)

    lines("step_ms", "step ms (median)", "step_ms", f"{device}: step time per stage", True)
    lines("exposed_ms", "exposed comm ms (median)", "exposed_comm",
          f"{device}: exposed communication per stage", False)

    fig, axes = panels(f"{device}: compute and exposed comm at the largest N")
    for ax, config in zip(axes, configs):
        picked = []
        for stage in stages:
            pts = [r for r in rows if r["config"] == config and r["stage"] == stage]
            if pts:
                picked.append(max(pts, key=lambda r: r["n"]))
        labels = [f"{r['stage'][:2]}\nN={r['n']}" for r in picked]
        exposed = [r["exposed_ms"] for r in picked]
        compute = [max(r["step_ms"] - r["exposed_ms"], 0.0) for r in picked]
        ax.bar(labels, compute, color="#4878cf", label="compute (step − exposed comm)")
        ax.bar(labels, exposed, bottom=compute, color="#e08a2c", label="exposed comm")
        ax.set_ylabel("ms per step (median)")
        ax.set_title(config)
        ax.grid(True, axis="y", alpha=0.3)
    save(fig, "breakdown", axes)
    return paths


# ---------------------------------------------------------------------------------------------


def write_csv(rows, path, fields=CSV_FIELDS):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else
                            f"{r[k]:.6g}" if isinstance(r[k], float) else r[k])
                        for k in fields})


def missing_outputs(paths):
    """verify*'s first problems: each of the files that is absent or empty."""
    return [f"missing output: {p}" for p in paths if not p.is_file() or p.stat().st_size == 0]


def read_csv_rows(path):
    """A CSV file's rows, as dicts of strings."""
    with open(path) as f:
        return list(csv.DictReader(f))


def verify(out, device, expected, peak_measured, reference_ran, sections):
    """Reads the outputs back: the files exist, the CSV has every expected row and cell, the
    markdown has the sections and one table row per CSV row. Returns the problems."""
    csv_path = out / "benchmarks" / f"{device}.csv"
    md_path = out / "benchmarks.md"
    figs = [out / "figures" / f"bench_{device}_{k}.svg"
            for k in ("step_ms", "exposed_comm", "breakdown")]
    if problems := missing_outputs([csv_path, md_path] + figs):
        return problems
    rows = read_csv_rows(csv_path)
    problems += missing_cells(rows, expected, peak_measured, reference_ran)
    text = md_path.read_text()
    for name in sections:
        if f"<!-- tpx-bench:begin {name} -->" not in text:
            problems.append(f"{md_path}: no section '{name}'")
    body = section_body(text, device)
    for name in SUBSECTIONS:  # their own tables: verify_cp, verify_pp
        if f"<!-- tpx-bench:begin {device}-{name} -->" in body:
            head, rest = body.split(f"<!-- tpx-bench:begin {device}-{name} -->", 1)
            body = head + rest.split(f"<!-- tpx-bench:end {device}-{name} -->", 1)[-1]
    for r in rows:
        if not re.search(rf"^\| {re.escape(r['stage'])} \| {r['n']} \| {device} \|", body, re.M):
            problems.append(f"{md_path}: no table row for {r['config']}/{r['stage']}/N={r['n']}")
    table_rows = [ln for ln in body.splitlines()
                  if re.match(r"^\| 0[1-9]_\w+(?: [A-Z]\d+)? \| \d+ \|", ln)]
    width = len([h for _, h, _ in COLUMNS if h])
    for ln in table_rows:
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if len(cells) != width or any(c == "" for c in cells):
            problems.append(f"{md_path}: incomplete row: {ln}")
    if len(table_rows) != len(rows):
        problems.append(f"{md_path}: {len(table_rows)} table rows for {len(rows)} CSV rows")
    return problems


def section_body(text, name):
    """The text between the section NAME's markers ("" if it has none)."""
    begin, end = f"<!-- tpx-bench:begin {name} -->", f"<!-- tpx-bench:end {name} -->"
    if begin not in text:
        return ""
    return text.split(begin, 1)[1].split(end, 1)[0]


def verify_cp(out, device, expected, expected_attention, peak_measured):
    """Reads stage 08's outputs back: the two CSVs and the plot exist, the stage table has every
    expected point and cell, the attention CSV every expected (S, C) with a positive time (and
    the ring steps' time and rank 0's cp_attention_ms where C > 1), and the subsection one
    table row per CSV row."""
    csv_path = out / "benchmarks" / f"{device}_cp.csv"
    att_path = out / "benchmarks" / f"{device}_cp_attention.csv"
    fig = out / "figures" / f"bench_{device}_cp_attention.svg"
    md_path = out / "benchmarks.md"
    if problems := missing_outputs((csv_path, att_path, md_path) +
                                   ((fig,) if expected_attention else ())):
        return problems
    rows = read_csv_rows(csv_path)
    att = read_csv_rows(att_path)
    problems += missing_cells(rows, expected, peak_measured, True)
    have = {(int(r["seq"]), int(r["c"])): r for r in att}
    for seq, c in expected_attention:
        if (seq, c) not in have:
            problems.append(f"no attention row for S {seq}, C {c}")
    for (seq, c), r in have.items():
        for field in ATTENTION_FIELDS:
            v = r.get(field, "")
            if v == "" and field in ("blocks_ms", "cp_attention_ms_rank0") and c == 1:
                continue  # stage 08 at C = 1 is stage 07: no ring blocks to time
            try:
                ok = math.isfinite(float(v)) and float(v) > 0
            except ValueError:
                ok = False
            if not ok:
                problems.append(f"attention S={seq} C={c}: {field} is '{v}'")
    body = section_body(md_path.read_text(), f"{device}-cp")
    if not body:
        problems.append(f"{md_path}: no section '{device}-cp'")
        return problems
    for r in rows:
        if not re.search(rf"^\| {re.escape(r['stage'])} \| {r['c']} × {r['t']} \| {r['n']} \|",
                         body, re.M):
            problems.append(f"{md_path}: no table row for {r['config']}/{r['stage']}/N={r['n']}")
    for r in att:
        if not re.search(rf"^\| {r['seq']} \| {r['c']} \| {r['n']} \|", body, re.M):
            problems.append(f"{md_path}: no attention row for S={r['seq']} C={r['c']}")
    return problems


def verify_pp(out, device, expected):
    """Reads stage 09's outputs back: the CSV and the plot exist, the CSV has a row for every
    expected (schedule, P, V, M) with a measured bubble in [0, 1) and its spread around it, a
    positive step time and pp bytes, a live count per pipeline rank, and a formula wherever the
    schedule has one (ZB-H1 below M = P has none); the subsection one table row per CSV row."""
    csv_path = out / "benchmarks" / f"{device}_pp.csv"
    fig = out / "figures" / f"bench_{device}_pp_bubble.svg"
    md_path = out / "benchmarks.md"
    if problems := missing_outputs((csv_path, md_path) + ((fig,) if expected else ())):
        return problems
    rows = read_csv_rows(csv_path)
    have = {(r["schedule"], int(r["p"]), int(r["v"]), int(r["m"])): r for r in rows}
    for point in expected:
        if point not in have:
            problems.append(f"no row for {point[0]} P={point[1]} V={point[2]} M={point[3]}")
    body = section_body(md_path.read_text(), f"{device}-pp")
    if not body:
        return problems + [f"{md_path}: no section '{device}-pp'"]
    for (s, p, v, m), r in have.items():
        where = f"{s} P={p} V={v} M={m}"

        def number(field):
            try:
                x = float(r.get(field, ""))
            except ValueError:
                return None
            return x if math.isfinite(x) else None
        lo, mid, hi = (number(k) for k in ("bubble_min", "bubble", "bubble_max"))
        if None in (lo, mid, hi) or not 0 <= lo <= mid <= hi < 1:
            problems.append(f"{where}: bubble {r.get('bubble')!r} not in [0, 1) within its "
                            f"spread {r.get('bubble_min')!r}–{r.get('bubble_max')!r}")
        for field in ("step_ms", "pp_bytes"):
            if not (number(field) or 0) > 0:
                problems.append(f"{where}: {field} is '{r.get(field)}'")
        if len(r.get("live_peak", "").split()) != p:
            problems.append(f"{where}: live_peak '{r.get('live_peak')}' has not {p} ranks")
        if number("formula") is None and not (s == "zb-h1" and m < p):
            problems.append(f"{where}: no formula bubble")
        if not re.search(rf"^\| {re.escape(s)} \| {p} \| {v} \| {m} \|", body, re.M):
            problems.append(f"{md_path}: no table row for {where}")
    return problems


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--build", default=str(ROOT / "build"), help="build directory (has bin/)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--repeats", type=int, default=3, help="runs per point (default 3)")
    ap.add_argument("--quick", action="store_true",
                    help="1 repeat, N = 1, 2, 3 steps, --max-bytes 64K, the default config only")
    ap.add_argument("--out", help="where benchmarks.md goes (default: docs/; with a selection, "
                                  "WORK/<device>/page)")
    ap.add_argument("--stages", type=stage_list, metavar="04,05",
                    help="only these stages (numbers or names, comma-separated)")
    ap.add_argument("--ranks", type=rank_list, metavar="2,4",
                    help="only these rank counts N (comma-separated)")
    model = ap.add_mutually_exclusive_group()
    model.add_argument("--model", metavar="NAME",
                       help="one config: this preset, forwarded to every stage and tpx_project")
    model.add_argument("--config", metavar="FILE",
                       help="one config: this file, forwarded to every stage and tpx_project")
    ap.add_argument("--work", default=str(ROOT / "out" / "bench"),
                    help="raw --json files and logs (a folder per device)")
    ap.add_argument("--mpirun", default="mpirun --oversubscribe --bind-to none")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per program run")
    ap.add_argument("--command", help="the command to print as the one that made the tables")
    ap.add_argument("--from-logs", metavar="DIR", action="append",
                    help="write the CUDA section from a GPU run's log folder (runs nothing); "
                         "given again, one subsection per run, the first the newest")
    ap.add_argument("--only", choices=["projection", "text", "cp", "pp"],
                    help="regenerate only part of benchmarks.md: projection (runs tpx_project "
                         "alone, no stage runs), text (the intro, and each device section's "
                         "line of what ran, from its CSV; runs nothing) or cp (stage 08's "
                         "subsection: bench_gemm's peak, then its stage table and attention "
                         "against S) or pp (stage 09's subsection: each schedule's bubble "
                         "against M)")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    if a.command is None:
        a.command = shlex.join(["tools/bench.py"] + (sys.argv[1:] if argv is None else argv))
    missing_run = next((d for d in a.from_logs or [] if not pathlib.Path(d).is_dir()), None)
    bad_path = (f"--config {a.config}: no such file" if a.config and
                not pathlib.Path(a.config).is_file() else
                f"--from-logs {missing_run}: no such directory" if missing_run else
                f"--build {a.build}: no such directory"
                if a.only != "text" and not a.from_logs and not pathlib.Path(a.build).is_dir()
                else None)
    if bad_path:  # one line and exit 2, as every tool in tools/ answers a bad path
        print(f"bench: error: {bad_path}", file=sys.stderr)
        return 2
    if a.out is None:
        selection = a.stages or a.ranks or a.model or a.config
        a.out = str(pathlib.Path(a.work) / a.device / "page") if selection else str(ROOT / "docs")
    try:
        return drive(a)
    except BenchError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 1


def stage_list(text):
    """--stages: "04,05" or "04_overlap_ring,5" as STAGES' names, in STAGES' order."""
    chosen = []
    for token in filter(None, (t.strip() for t in text.split(","))):
        hits = [s for s in STAGES if s == token or (token.isdigit() and int(s[:2]) == int(token))]
        if not hits:
            raise argparse.ArgumentTypeError(
                f"no stage '{token}' (stages: {', '.join(s[:2] for s in STAGES)}, or their names)")
        chosen += hits
    if not chosen:
        raise argparse.ArgumentTypeError("no stage given")
    return [s for s in STAGES if s in chosen]


def rank_list(text):
    """--ranks: "2,4" as sorted distinct positive integers."""
    try:
        ranks = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers")
    if not ranks or ranks[0] < 1:
        raise argparse.ArgumentTypeError(f"'{text}': rank counts are positive integers")
    return ranks


GPU_RUNS = ROOT / "docs" / "gpu-runs"  # published GPU runs, one folder each (DATE-GPU)
GPU_DEVICE_FILE = ROOT / "tools" / "devices" / "h100_sxm.json"  # the projection's, and the run's
# The projection's views of the one measured step: (tpx_project flags, what it models, the
# measured step it is compared with: tpx's own, or PyTorch's on the same GPU).
MEASURED_CHECK = [
    (["--assumed"], "the device file's assumptions alone (GEMM efficiency up to 0.78 of the "
                    "datasheet peak, attention at 0.5 of it): the model as it was before the run",
     "tpx"),
    (["--attention", "fused"], "measured GEMMs, tpx's fused attention as measured: tpx as it is",
     "tpx"),
    (["--attention", "sdpa"], "measured GEMMs, PyTorch SDPA's attention as measured: what a "
                              "FlashAttention-class kernel would give", "torch"),
]


def error_line(projected_ms, measured_ms):
    """'−9.2 %' within a factor of 2, else '4.7× too fast' / '2.1× too slow'."""
    ratio = projected_ms / measured_ms
    if 0.5 <= ratio <= 2:
        return f"{(ratio - 1) * 100:+.1f} %"
    return f"{1 / ratio:.1f}× too fast" if ratio < 1 else f"{ratio:.1f}× too slow"


def latest_gpu_run(runs=GPU_RUNS, gpu="H100"):
    """The newest published run folder on a `gpu` (the projection's device: its reports' device
    name holds the word) that has a big stage 01 log, or None."""
    import gpu_logs

    def on_gpu(p):
        f = gpu_logs.files_of(p)
        try:
            return f["big"].is_file() and gpu in gpu_logs.report_md(f["report"])["device"]
        except gpu_logs.LogError:
            return False
    found = sorted(p for p in runs.glob("*") if p.is_dir() and on_gpu(p))
    return found[-1] if found else None


def measured_check(exe, device_file, work, timeout, run_dir=None):
    """The projection against the one measured GPU step (stage 01 at the big log's shape): lines
    of markdown, projected by `exe` in each MEASURED_CHECK view; [] without a published run."""
    import gpu_logs
    run_dir = run_dir or latest_gpu_run()
    if run_dir is None:
        return []
    f = gpu_logs.files_of(run_dir)
    try:
        big = gpu_logs.stage_log(f["big"])
        report = gpu_logs.report_md(f["report"])
        commit = gpu_logs.readme_commit(f["readme"])
        torch = gpu_logs.torch_log(f["torch"])
    except gpu_logs.LogError as e:
        raise BenchError(str(e))
    s = big["sizes"]
    flags = ["--hidden", s["hidden"], "--heads", s["heads"], "--kv-heads", s["kv_heads"],
             "--ffn", s["ffn"], "--seq", s["seq"], "--batch", s["batch"], "--layers", s["layers"],
             "--dtype", big["dtype"], "--tp", 1]
    rows = []
    for i, (view, what, against) in enumerate(MEASURED_CHECK):
        js = work / f"measured_check.{i}.json"
        js.unlink(missing_ok=True)
        cmd = [str(exe), "--device", str(device_file)] + view + [str(f) for f in flags] + [
            "--json", str(js)]
        rc, last = run(cmd, work / f"measured_check.{i}.log", timeout)
        if rc != 0 or not js.is_file():
            raise BenchError(f"`{show(cmd)}` failed (exit {rc}): {last}")
        stage = next((r for r in json.loads(js.read_text())["stages"]
                      if r["stage"] == big["stage"]), None)
        if stage is None:
            raise BenchError(f"{js}: no {big['stage']} row")
        ms = stage["step_ms"]
        measured = ([("tpx", big["step_ms"])] if against == "tpx" else
                    [("PyTorch eager", torch["eager"]["step_ms"]),
                     ("torch.compile", torch["compile"]["step_ms"])])
        rows.append([what, "`" + " ".join(view) + "`", f"{ms:.2f}",
                     ", ".join(f"{who} {m:.2f}" for who, m in measured),
                     ", ".join(f"{error_line(ms, m)}" + (f" vs {who}" if len(measured) > 1
                                                         else "") for who, m in measured)])
    log = os.path.relpath(f["big"], ROOT / "docs")
    shape = " ".join(f"{k} {s[v]}" for k, v in (("H", "hidden"), ("NH", "heads"), ("F", "ffn"),
                                                 ("S", "seq"), ("B", "batch"), ("L", "layers")))
    return [f"**First, the model against the one measured GPU step**: {big['stage']}, "
            f"{big['dtype']}, {shape}, one training step on one {big['device']['name']} "
            f"({report['date']}, commit `{commit}`, [its log]({log})): measured "
            f"{big['step_ms']:.2f} ms (PyTorch on the same GPU and block: eager "
            f"{torch['eager']['step_ms']:.2f} ms, torch.compile {torch['compile']['step_ms']:.2f} "
            "ms). The model's constants were not chosen against this step "
            "(the GEMM and attention rates come from the micro-benchmarks of the same run), so it "
            "is held out. Until a projection is within a few per cent of a measured step, do not "
            "trust the TP rows below for more than their order.", ""] + md_table(
        ["what the model uses", "tpx_project flags", "projected ms", "measured ms (same GPU)",
         "error"],
        rows).split("\n") + ["", "The tables below use the device file's default: measured GEMMs and "
                 "SDPA-class attention (what the stages' schemes would cost with a fast attention "
                 "kernel; on that run tpx's own fused kernel was about 40× slower than SDPA; the "
                 "CUDA section has the later runs).", ""]


def projection_section(a, d, projection, proj_cmd, proj_note, check=()):
    proj = ["## Projection (H100 SXM, projected)", ""]
    if projection is None:
        return proj + [proj_note]
    return proj + list(check) + [
        "Projected by the model, not measured. Date: " + d.date + ". Command: `"
        + show(proj_cmd) + "` (run by `" + a.command + "`); its markdown, verbatim:", "",
        projection.strip()]


def drive_projection(a, d, out):
    """--only projection: tpx_project alone, its section of benchmarks.md replaced."""
    projection, proj_cmd, proj_note = d.projection()
    if projection is None:
        raise BenchError(proj_note)
    check = measured_check(d.exe("tpx_project"), GPU_DEVICE_FILE, d.work, a.timeout)
    md = out / "benchmarks.md"
    text = benchmarks_md(md)
    text = replace_section(text, "projection", "\n".join(
        projection_section(a, d, projection, proj_cmd, proj_note, check)))
    md.write_text(text.rstrip("\n") + "\n")
    print(f"wrote the projection section of {md}")
    return 0


def ran_text_from_csv(path):
    """ran_text() for a section already written, from its CSV: the stages, N and configs that
    have rows, and the repeats and steps the rows record."""
    rows = read_csv_rows(path)
    if not rows:
        raise BenchError(f"{path} has no rows")
    stages = [s for s in STAGES if any(split_label(r["stage"])[0] == s for r in rows)]
    ranks = sorted({int(r["n"]) for r in rows})
    configs = [{"name": c} for c in dict.fromkeys(r["config"] for r in rows)]
    return ran_text(stages, ranks, configs, int(rows[0]["repeats"]), int(rows[0]["steps"]), False,
                    mesh_points_of(rows))


def drive_text(out):
    """--only text: the intro, and the "Ran ..." line of each device section that has a CSV,
    written before the section's "Each point:" paragraph (replacing the one there)."""
    md = out / "benchmarks.md"
    text = benchmarks_md(md)
    for device in ("cpu", "cuda"):
        path = out / "benchmarks" / f"{device}.csv"
        begin, end = f"<!-- tpx-bench:begin {device} -->", f"<!-- tpx-bench:end {device} -->"
        if not path.is_file() or begin not in text:
            continue
        head, rest = text.split(begin, 1)
        body, tail = rest.split(end, 1)
        lines = body.split("\n")
        for i in [i for i, ln in enumerate(lines) if re.match(r"^(Quick mode\. )?Ran `", ln)][::-1]:
            del lines[i:i + 2 if i + 1 < len(lines) and not lines[i + 1] else i + 1]
        at = next((i for i, ln in enumerate(lines) if ln.startswith("Each point:")), None)
        if at is None:
            raise BenchError(f"{md}: the {device} section has no 'Each point:' paragraph")
        lines[at:at] = [ran_text_from_csv(path), ""]
        text = head + begin + "\n".join(lines) + end + tail
    md.write_text(text.rstrip("\n") + "\n")
    print(f"wrote the text of {md}")
    return 0


def datasheet_file(run):
    """The device file whose datasheet peak a run's GEMM rows are compared with."""
    name = run["big"]["device"]["name"]
    return ROOT / "tools" / "devices" / "h200.json" if "H200" in name else GPU_DEVICE_FILE


def from_logs_outputs(out, folder, first):
    """The CSV and the figure of one run of --from-logs: the first (newest) run's keep the names
    of a one-run page; an earlier run's carry its folder's name."""
    tag = "" if first else f".{folder.name}"
    return (out / "benchmarks" / f"cuda_run{tag}.csv",
            out / "figures" / f"bench_cuda_attention{tag}.svg")


def drive_from_logs(a, out):
    """--from-logs DIR [--from-logs DIR2 …]: the CUDA section, its CSV and plot from GPU runs'
    logs, newest first; runs nothing. One run: the section is that run's. Several: a table of the
    runs side by side, then one subsection per run (its own CSV and plot)."""
    import gpu_logs
    try:
        import matplotlib  # noqa: F401  (the plot; checked before anything is written)
    except ImportError:
        raise BenchError("matplotlib is missing (Debian: apt-get install python3-matplotlib; "
                         "scripts/setup.sh installs it)")
    folders = [pathlib.Path(f).resolve() for f in a.from_logs]
    try:
        runs = [gpu_logs.load_run(f) for f in folders]
    except gpu_logs.LogError as e:
        raise BenchError(str(e))
    bodies, written = [], []
    for i, (folder, run) in enumerate(zip(folders, runs)):
        # Links as docs/benchmarks.md reaches the folder, wherever --out puts the page.
        where = os.path.relpath(folder, ROOT / "docs")
        datasheet = json.loads(datasheet_file(run).read_text())["peak_bf16_flops"] / 1e12
        csv_path, figure = from_logs_outputs(out, folder, i == 0)
        bodies.append(gpu_logs.cuda_section(run, where, a.command, datasheet, csv_path,
                                            "figures/" + figure.name, latest=i == 0))
        gpu_logs.write_csv(run, csv_path)
        gpu_logs.plot_attention(run, figure)
        written += [csv_path, figure]
    if len(runs) == 1:
        body = bodies[0]
    else:
        wheres = [os.path.relpath(f, ROOT / "docs") for f in folders]
        body = gpu_logs.runs_side_by_side(runs, wheres, a.command)
        for i, (run, lines) in enumerate(zip(runs, bodies)):
            body += ["", gpu_logs.run_heading(run, latest=i == 0), ""]
            body += [("#" + ln) if ln.startswith("### ") else ln
                     for ln in lines if not ln.startswith("## ")][1:]
    md = out / "benchmarks.md"
    text = replace_section(benchmarks_md(md), "cuda", "\n".join(body))
    md.write_text(text.rstrip("\n") + "\n")
    problems = missing_outputs([md] + written)
    if problems:
        raise BenchError("the outputs are incomplete:\n  " + "\n  ".join(problems))
    print(f"wrote the cuda section of {md}, {', '.join(str(w) for w in written)} from "
          f"{', '.join(str(rel(f)) for f in folders)}")
    return 0


def drive(a):
    if a.from_logs:  # before Driver: no build, no runs
        out = pathlib.Path(a.out)
        return drive_from_logs(a, out)
    d = Driver(a)
    d.work.mkdir(parents=True, exist_ok=True)
    out = pathlib.Path(a.out)
    if a.only == "projection":  # no plots: matplotlib is not needed
        return drive_projection(a, d, out)
    if a.only == "text":
        return drive_text(out)
    try:
        import matplotlib  # noqa: F401  (checked before the runs, not after them)
    except ImportError:
        raise BenchError("matplotlib is missing (Debian: apt-get install python3-matplotlib; "
                         "scripts/setup.sh installs it)")

    if a.only in SUBSECTIONS and (a.model or a.config):
        raise BenchError(f"--only {a.only} runs {SUBSECTIONS[a.only]} on its own sizes: leave "
                         "out --model / --config")
    chosen = a.stages or STAGES
    main, wanted = parts(chosen, a.only, bool(a.model or a.config))
    cp_wanted, pp_wanted = "cp" in wanted, "pp" in wanted

    # The peak first: bench_gemm's largest GEMM, before the stages load the machine.
    gemm, chunked, gemm_cmd, gemm_note = (d.bench_gemm() if a.only != "pp" else
                                          (None, None, None, None))  # stage 09's: no MFU
    peak = measured_peak(gemm, a.device)
    peak_tflops = peak["tflops"] if peak else None
    rows, cp_rows, att = [], [], []
    if main:
        load_before = load_average()
        stages, rows, expected, skipped, refused = d.sweep(main)
        loads = (load_before, load_average())
        if not rows:  # e.g. every stage refused the --model / --config given
            why = skipped + [f"{name}: {line}" for name, line in refused.items()]
            raise BenchError("no point ran" + (": " + "; ".join(why) if why else ""))
        for name, stage in SUBSECTIONS.items():
            if stage in chosen and name not in wanted:
                skipped.append(f"`{stage}`: its subsection runs on its own sizes only, not with "
                               "--model / --config")
        add_derived(rows, peak_tflops)
    if cp_wanted:
        load_before = load_average()
        cp_rows, att, cp_expected, att_expected, cp_left = d.cp_sweep()
        cp_loads = (load_before, load_average())
        if not cp_rows and not att:
            raise BenchError(f"no point of {CP_STAGE}'s sweep ran: " + "; ".join(cp_left))
        add_derived(cp_rows, peak_tflops)
    pp_rows = []
    if pp_wanted:
        load_before = load_average()
        pp_rows, pp_expected, pp_left = d.pp_sweep()
        pp_loads = (load_before, load_average())
        if not pp_rows:
            raise BenchError(f"no point of {PP_STAGE}'s sweep ran: " + "; ".join(pp_left))

    R = Render(d, device_description(a.device, rows + cp_rows))
    md = out / "benchmarks.md"
    text = benchmarks_md(md)
    cp_block = R.cp_section(cp_rows, att, cp_left, cp_loads, peak) if cp_wanted else []
    pp_block = R.pp_section(pp_rows, pp_left, pp_loads) if pp_wanted else []
    if pp_wanted:
        write_csv(pp_rows, out / "benchmarks" / f"{a.device}_pp.csv", PP_FIELDS)
        plot_pp_bubble(pp_rows, a.device, out / "figures")
    if cp_wanted:
        write_csv(cp_rows, out / "benchmarks" / f"{a.device}_cp.csv", CP_CSV_FIELDS)
        write_csv(att, out / "benchmarks" / f"{a.device}_cp_attention.csv", ATTENTION_FIELDS)
        if att:
            plot_cp_attention(att, a.device, out / "figures")
    if main:
        collectives = d.bench_collectives()
        projection, proj_cmd, proj_note = d.projection()
        body = R.stage_section(stages, rows, skipped, refused, peak, gemm_cmd, loads)
        for block in (cp_block, pp_block):
            if block:
                body += [""] + block
        body += ["", f"### Micro-benchmarks ({a.device})", ""]
        body += R.gemm_section(gemm, chunked, gemm_cmd, gemm_note)
        body += R.collectives_section(collectives)
        check = (measured_check(d.exe("tpx_project"), GPU_DEVICE_FILE, d.work, a.timeout)
                 if projection is not None else [])
        proj = projection_section(a, d, projection, proj_cmd, proj_note, check)
        write_csv(rows, out / "benchmarks" / f"{a.device}.csv")
        plot(rows, a.device, stages, out / "figures")
        text = replace_section(text, a.device, "\n".join(body))
        text = replace_section(text, "projection", "\n".join(proj))
    else:
        for name, block in (("cp", cp_block), ("pp", pp_block)):
            if block:
                text = replace_subsection(text, a.device, name, block)
    md.write_text(text.rstrip("\n") + "\n")

    problems = []
    if main:
        problems += verify(out, a.device, expected, peak is not None, REFERENCE_STAGE in stages,
                           SECTIONS)
        wrong = [(n, op) for n, ops, _, _ in collectives if ops for op, rs in ops.items()
                 if any(r["wrong"] for r in rs)]
        for n, op in wrong:  # a benchmark program's failure: flagged in its section, not fatal
            print(f"bench: WARNING: bench_collectives: WRONG RESULTS for {op} at N={n}",
                  file=sys.stderr)
        print(f"wrote {md}, {out / 'benchmarks' / (a.device + '.csv')}, "
              f"{out / 'figures'}/bench_{a.device}_*.svg ({len(rows)} rows)")
        for note in [gemm_note, proj_note] + [c[3] for c in collectives]:
            if note:
                print(f"note: {note}")
    if cp_wanted:
        problems += verify_cp(out, a.device, cp_expected, att_expected, peak is not None)
        print(f"wrote stage 08's subsection of {md}, {out / 'benchmarks'}/{a.device}_cp*.csv, "
              f"{out / 'figures'}/bench_{a.device}_cp_attention.svg ({len(cp_rows)} + "
              f"{len(att)} rows)")
    if pp_wanted:
        problems += verify_pp(out, a.device, pp_expected)
        print(f"wrote stage 09's subsection of {md}, {out / 'benchmarks'}/{a.device}_pp.csv, "
              f"{out / 'figures'}/bench_{a.device}_pp_bubble.svg ({len(pp_rows)} rows)")
    if problems:
        raise BenchError("the outputs are incomplete:\n  " + "\n  ".join(problems))
    return 0


def parts(chosen, only, preset):
    """(the stages of the stage tables, the subsections that run: names of SUBSECTIONS) for the
    stages chosen, --only and whether --model / --config was given: stages 08 and 09 are in
    their subsections only, which run on their own sizes (--only NAME: that one alone)."""
    if only in SUBSECTIONS:
        return [], [only]
    main = [s for s in chosen if s not in SUBSECTIONS.values()]
    wanted = [] if preset else [n for n, s in SUBSECTIONS.items() if s in chosen]
    if not main and not wanted:
        raise BenchError(f"{' and '.join(SUBSECTIONS.values())} run on their own sizes only: "
                         "with --model / --config choose other stages")
    return main, wanted


def replace_subsection(text, device, name, block):
    """text with the subsection NAME (block: its lines, markers included) replaced, or put into
    the device's section before its micro-benchmarks (or at its end) if it has none yet: after
    the subsections before it."""
    marker = f"{device}-{name}"
    if f"<!-- tpx-bench:begin {marker} -->" in text:
        return replace_section(text, marker, "\n".join(block[1:-1]))
    begin, end = f"<!-- tpx-bench:begin {device} -->", f"<!-- tpx-bench:end {device} -->"
    body = section_body(text, device)
    micro = f"\n### Micro-benchmarks ({device})\n"
    at = (text.index(begin) + len(begin) + body.index(micro) + 1 if micro in body
          else text.index(end))
    head = text[:at] if text[:at].endswith("\n\n") else text[:at].rstrip("\n") + "\n\n"
    return head + "\n".join(block) + "\n\n" + text[at:]


if __name__ == "__main__":
    sys.exit(main())
