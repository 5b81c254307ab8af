"""The driver's arithmetic (tools/test_bench.py checks every function here on numbers worked by
hand): means, medians, TFLOP/s, MFU, bus GB/s, speed-ups, the plans of stage 08's and stage 09's
subsections, and each point's summary from its --json and --trace files.
"""
import math
import statistics

from .config import (CP_ATTENTION_C, CP_ATTENTION_SEQS, CP_STAGE, CP_TABLE_SEQS, DEFAULTS,
                     MESH_STAGES, MIB, PP_DEGREES, PP_MICROBATCHES, PP_SCHEDULES, PP_SIZES,
                     REFERENCE_STAGE, SIZE_KEYS, BenchError, stage_label)


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
    z = PP_SIZES[quick]
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
