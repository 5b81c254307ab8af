#!/usr/bin/env python3
"""The logs of a GPU run made elsewhere (scripts/gpu-validate.sh's folders, as in docs/gpu-runs/),
read back: small strict parsers, one per kind of log, and the CUDA section of docs/benchmarks.md,
its CSV and its plot written from them by `tools/bench.py --from-logs DIR` (nothing is run).

A parser that does not find a line it expects raises LogError naming the file and the line.

    tools/gpu_logs.py DIR                      the facts read from DIR, as JSON
    tools/gpu_logs.py --compare LOGDIR         gpu-validate.sh's bench table from OUTDIR/logs: tpx
                                               attention beside SDPA, stage 01 beside PyTorch
    tools/gpu_logs.py --gbench-json LOG        a Google Benchmark console log as its JSON form
                                               (what `tpx_project --calibrate` reads)
    tools/gpu_logs.py --device-file FILE DIR [--write]
                                               check (or write) FILE's "measured" block: the bf16
                                               GEMM efficiencies and attention rates of DIR's logs

The run folder's layout (gpu-validate.sh's step logs, and the extra logs beside them):
    README.md                          what ran: "What ran: commit `abc1234`"
    logs/report-unit.md                "- date:", "- device: name, driver, mode", "- commit:"
    logs/unit/logs/01-nvidia-smi.log   "Driver Version: …"
    logs/big/logs/01-01.big.bf16.log   stage 01 at the big shape ("mean step … ms")
    logs/bench/logs/0N-*.log           bench_copy_overlap, bench_gemm, bench_attention (console),
                                       sdpa_bench.py
    logs/torchperf.log                 PyTorch eager and torch.compile on the same block
    logs/ncu-step.txt                  Nsight Compute's summary over the launches of a stage 01 run
A run whose parts were run as gpu-validate.sh now names them has its facts in their own part and
PyTorch's step in the bench part; where a file above is absent, its place there is read:
    logs/report-facts.md, logs/facts/logs/01-nvidia-smi.log, logs/bench/logs/NN-torch_block_perf.log
(and a bench log at another number, NN-bench_gemm.log). Where the bench part ran stage 01 itself
(logs/bench/logs/NN-01.big.bf16.bench.log, right after PyTorch's step), that run is the one
read. Nsight Compute's summary is optional: a run without it has no "where the time goes" table.
"""
import argparse
import csv
import io
import json
import pathlib
import re
import sys

FILES = {
    "readme": "README.md",
    "report": "logs/report-unit.md",
    "smi": "logs/unit/logs/01-nvidia-smi.log",
    "big": "logs/big/logs/01-01.big.bf16.log",
    "copy": "logs/bench/logs/01-bench_copy_overlap.log",
    "gemm": "logs/bench/logs/02-bench_gemm.log",
    "attention": "logs/bench/logs/03-bench_attention.log",
    "sdpa": "logs/bench/logs/04-sdpa_bench.log",
    "torch": "logs/torchperf.log",
    "ncu": "logs/ncu-step.txt",
}
# Where a run folder of another layout has what FILES names (tried in this order after FILES).
ALTERNATIVES = {
    "report": ["logs/report-facts.md"],
    "smi": ["logs/facts/logs/*-nvidia-smi.log", "logs/*/logs/*-nvidia-smi.log"],
    "copy": ["logs/bench/logs/*-bench_copy_overlap.log"],
    "gemm": ["logs/bench/logs/*-bench_gemm.log"],
    "attention": ["logs/bench/logs/*-bench_attention.log"],
    "sdpa": ["logs/bench/logs/*-sdpa_bench.log"],
    "torch": ["logs/bench/logs/*-torch_block_perf.log"],
}
# Where a run folder has these, they come before FILES: stage 01 as the bench part ran it, right
# after PyTorch's step on the same block (the big part runs it too, on its own).
PREFERRED = {"big": ["logs/bench/logs/*-01.big.bf16*.log"]}
OPTIONAL = {"ncu"}  # a run may lack these; the others are needed
UNIT_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
# The FLOPs bench_attention and sdpa_bench count for a causal forward + backward
# (FlashAttention-2's convention): 3.5 × the forward's 4·B·NH·S²·D / 2.
ATTENTION_STEP = 3.5 / 2


class LogError(Exception):
    """A log that does not say what it should: the message names the file."""


def read(path):
    try:
        return pathlib.Path(path).read_text(errors="replace")
    except OSError as e:
        raise LogError(f"{path}: cannot read ({e.strerror})")


def need(pattern, text, path, what, flags=0):
    """The first match of pattern in text, or LogError naming the file and what is missing."""
    m = re.search(pattern, text, flags)
    if not m:
        raise LogError(f"{path}: no {what}")
    return m


def number(text):
    """A Google Benchmark counter as printed: 1.728k, 25.344k, 809.2, 128M."""
    scale = {"k": 1e3, "M": 1e6, "G": 1e9}
    m = re.fullmatch(r"(-?[0-9.]+(?:e[-+]?\d+)?)([kMG]?)", text)
    if not m:
        raise ValueError(text)
    return float(m.group(1)) * scale.get(m.group(2), 1.0)


def cuda_device(text, path):
    """'tpx_device_cuda: NAME (sm_90, 132 SMs, 79.2 GiB)' or the stages' 'gpu NAME (…)'."""
    m = need(r"(?m)^(?:tpx_device_cuda: |gpu )(.+?) \((sm_\d+), (\d+) SMs, ([0-9.]+) GiB\)", text,
             path, "device line ('tpx_device_cuda: NAME (sm_XX, N SMs, M GiB)')")
    return {"name": m.group(1), "arch": m.group(2), "sms": int(m.group(3)),
            "memory_gib": float(m.group(4))}


def gbench_console(path):
    """A Google Benchmark console log: {device, date, rows, aborted}. Each row: name (without
    /real_time or /manual_time), timer ("real", "manual" or None: the suffix, which says whether
    the row was timed by the host clock or by CUDA events), time_ms, iterations, counters;
    `aborted` is the 'what():' line of an exception that ended the program, else None."""
    text = read(path)
    device = cuda_device(text, path)
    date = need(r"(?m)^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", text, path, "date line").group(1)
    head = need(r"(?m)^Benchmark +Time +CPU +Iterations", text, path, "table heading")
    rows = []
    for line in text[head.end():].splitlines()[1:]:
        if re.fullmatch(r"-+", line.strip()) or not line.strip():
            continue
        m = re.fullmatch(r"(\S+) +([0-9.]+) (ns|us|ms|s) +([0-9.]+) (?:ns|us|ms|s) +(\d+)(.*)",
                         line)
        if not m:
            break
        counters = {}
        for token in m.group(6).split():  # k=v, or m=n=k=4096 for three counters of one value
            *keys, v = token.split("=")
            if not keys:
                raise LogError(f"{path}: counter '{token}' is not NAME=VALUE: {line.strip()}")
            try:
                value = number(v)
            except ValueError:
                raise LogError(f"{path}: counter '{token}' is not a number: {line.strip()}")
            counters.update({k: value for k in keys})
        timer = re.search(r"/(real|manual)_time$", m.group(1))
        name = m.group(1)[:timer.start()] if timer else m.group(1)
        rows.append({"name": name, "timer": timer.group(1) if timer else None,
                     "time_ms": float(m.group(2)) * UNIT_MS[m.group(3)],
                     "iterations": int(m.group(5)), "counters": counters})
    if not rows:
        raise LogError(f"{path}: no benchmark rows under the table heading")
    aborted = re.search(r"(?m)^\s*what\(\):\s*(.+)$", text)
    return {"device": device, "date": date, "rows": rows,
            "aborted": aborted.group(1).strip() if aborted else None}


def gbench_json(console):
    """gbench_console()'s rows as Google Benchmark's JSON (what tpx_project --calibrate reads):
    the m, n, k counters as the label bench_gemm writes."""
    out = []
    for r in console["rows"]:
        c = r["counters"]
        b = {"name": r["name"] + "/real_time", "run_type": "iteration",
             "iterations": r["iterations"], "real_time": r["time_ms"], "time_unit": "ms"}
        b.update({k: v for k, v in c.items() if isinstance(v, float)})
        if all(k in c for k in "mnk"):
            b["label"] = f"m={int(c['m'])} n={int(c['n'])} k={int(c['k'])}"
        out.append(b)
    return {"context": {"source": "console log"}, "benchmarks": out}


def sdpa_log(path):
    """sdpa_bench.py's lines: {device, torch, rows: [{name, seq, time_ms, tflops}]}."""
    text = read(path)
    m = need(r"(?m)^sdpa_bench: (.+?), torch (\S+?),", text, path, "'sdpa_bench: DEVICE, torch …'")
    rows = [{"name": n, "seq": int(s), "head_dim": int(d or 128), "time_ms": float(t),
             "tflops": float(f)}
            for n, s, d, t, f in re.findall(
                r"(?m)^(attention/cuda/bf16/sdpa/S:(\d+)(?:/D:(\d+))?)\s.*?\s([0-9.]+) ms\s+"
                r"TFLOP/s=([0-9.]+)", text)]
    if not rows:
        raise LogError(f"{path}: no 'attention/cuda/bf16/sdpa/S:…  … ms  TFLOP/s=…' rows")
    return {"device": m.group(1), "torch": m.group(2), "rows": rows}


def stage_log(path):
    """A stage's console log: device, the measured bf16 GEMM peak, sizes, the mean step."""
    text = read(path)
    peak = need(r"bf16 GEMM peak ([0-9.]+) TFLOP/s \(measured by rank 0 alone before the steps: "
                r"([^)]*)\)", text, path, "'bf16 GEMM peak … TFLOP/s (measured …)'")
    flops = need(r"\| ([0-9.e+-]+) TFLOP per step per rank", text, path,
                 "'TFLOP per step per rank'")
    sizes = need(r"(?m)^H (\d+) NH (\d+) NKV (\d+) \(D (\d+)\) F (\d+) S (\d+) B (\d+) L (\d+)",
                 text, path, "size line ('H … NH … F … S … B … L …')")
    ranks = need(r"(?m)^ranks (\d+) \| device (\S+) \| dtype (\S+) \| attention (\S+)", text,
                 path, "'ranks N | device D | dtype T | attention A' line")
    stage = need(r"(?m)^tpx (\S+) \|", text, path, "'tpx STAGE |' line").group(1)
    mean = need(r"(?m)^mean step ([0-9.]+) ms \(exposed comm ([0-9.]+) ms; steps (\d+)-(\d+)",
                text, path, "'mean step … ms' line")
    keys = ["hidden", "heads", "kv_heads", "head_dim", "ffn", "seq", "batch", "layers"]
    return {"stage": stage, "device": cuda_device(text, path),
            "ranks": int(ranks.group(1)), "dtype": ranks.group(3), "attention": ranks.group(4),
            "peak_tflops": float(peak.group(1)), "peak_how": peak.group(2),
            "tflop_per_step": float(flops.group(1)),
            "sizes": dict(zip(keys, map(int, sizes.groups()))),
            "step_ms": float(mean.group(1)), "steps": f"{mean.group(3)}-{mean.group(4)}"}


def torch_log(path):
    """torch_block_perf.py's two lines: {eager|compile: {step_ms, tflops, what}}."""
    text = read(path)
    out = {}
    for mode in ("eager", "compile"):
        m = need(rf"(?m)^torch {mode}: mean step ([0-9.]+) ms, ([0-9.]+) TFLOP/s \((.*)\)$", text,
                 path, f"'torch {mode}: mean step … ms' line")
        out[mode] = {"step_ms": float(m.group(1)), "tflops": float(m.group(2)),
                     "what": m.group(3)}
    return out


def report_md(path):
    """gpu-validate.sh's report head: date, device name, driver, compute mode, commit."""
    text = read(path)
    date = need(r"(?m)^- date: (.+)$", text, path, "'- date:' line").group(1).strip()
    dev = need(r"(?m)^- device: (.+?), ([0-9.]+), (\S+) \(name, driver, compute mode\)$", text,
               path, "'- device: NAME, DRIVER, MODE' line")
    commit = need(r"(?m)^- commit: (\S+)$", text, path, "'- commit:' line").group(1)
    return {"date": date, "device": dev.group(1), "driver": dev.group(2), "mode": dev.group(3),
            "commit": commit}


def smi_driver(path):
    return need(r"Driver Version: (\S+)", read(path), path, "'Driver Version:'").group(1)


def readme_commit(path):
    return need(r"What ran: commit `([0-9a-f]{7,40})`", read(path), path,
                "'What ran: commit `…`'").group(1)


# Nsight Compute's kernel groups, first match wins: (group, pattern on the demangled name).
NCU_GROUPS = [
    ("attention (flash_forward_tc, flash_dq_tc, flash_dkdv_tc)", r"flash_\w+_tc<"),
    ("attention (flash_forward_mma, flash_bwd_mma)", r"flash_\w+_mma<"),
    ("attention's delta (flash_delta_kernel)", r"flash_delta_kernel"),
    ("GEMMs (cuBLASLt nvjet)", r"^nvjet_"),
    ("bf16 ↔ fp32 conversions", r"(bf16_to_f32|f32_to_bf16)_kernel"),
    ("SGD (map_kernel<Sgd>)", r"map_kernel<[^>]*Sgd>"),
    ("gradient norm (sum_squares, sum_partials)", r"sum_(squares|partials)_kernel"),
    ("RMSNorm", r"rmsnorm_"),
    ("element-wise (SwiGLU, RoPE, add, loss)", r"map_kernel<|rope_kernel"),
]


def ncu_summary(path):
    """Nsight Compute's --print-summary per-kernel: [{kernel, invocations, avg_ms, total_ms}],
    the number of launches profiled, and the stage's log lines printed under it. The invocations
    must add up to the '==PROF== Profiling' lines."""
    text = read(path)
    launches = len(re.findall(r"(?m)^==PROF== Profiling ", text))
    if not launches:
        raise LogError(f"{path}: no '==PROF== Profiling' lines")
    kernels = []
    for m in re.finditer(r"(?m)^  (\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\), Device \d+, "
                         r"CC [0-9.]+, Invocations (\d+)\n((?:    .*\n|\s*\n)*?)\n", text + "\n"):
        t = re.search(r"gpu__time_duration\.sum +(ns|us|ms|s) +([0-9.]+) +([0-9.]+) +([0-9.]+)",
                      m.group(3))
        if not t:
            raise LogError(f"{path}: kernel '{m.group(1)[:60]}' has no gpu__time_duration.sum row")
        avg = float(t.group(4)) * UNIT_MS[t.group(1)]
        name = re.sub(r"^void ", "", m.group(1))
        kernels.append({"kernel": name, "invocations": int(m.group(2)), "avg_ms": avg,
                        "total_ms": avg * int(m.group(2))})
    if not kernels:
        raise LogError(f"{path}: no per-kernel summary ('…, Invocations N' blocks)")
    counted = sum(k["invocations"] for k in kernels)
    if counted != launches:
        raise LogError(f"{path}: the summary counts {counted} invocations, the log profiled "
                       f"{launches} launches")
    for k in kernels:
        short = re.sub(r"tpx::<unnamed>::", "", k["kernel"]).split("(")[0]
        k["short"] = short
        k["group"] = next((g for g, p in NCU_GROUPS if re.search(p, short)), "other")
    steps = need(r"(?m)^H .* \| steps (\d+) ", text, path, "stage size line ('… | steps N')")
    return {"kernels": kernels, "launches": launches, "steps": int(steps.group(1)),
            "stage": stage_log(path)}


def ncu_groups(ncu):
    """[(group, invocations, total ms, share of the profiled total)] by total, largest first;
    the attention kernels also one by one: [(kernel, invocations, ms per launch)]."""
    total = sum(k["total_ms"] for k in ncu["kernels"])
    groups = {}
    for k in ncu["kernels"]:
        g = groups.setdefault(k["group"], [0, 0.0])
        g[0] += k["invocations"]
        g[1] += k["total_ms"]
    rows = sorted(((g, n, ms, ms / total) for g, (n, ms) in groups.items()),
                  key=lambda r: -r[2])
    attention = [(k["short"], k["invocations"], k["avg_ms"]) for k in ncu["kernels"]
                 if k["group"].startswith("attention (")]
    return rows, attention, total


def files_of(folder):
    """{key: path} of FILES in a run folder: the first of PREFERRED that exists, else FILES' own
    path where it exists, else the first of ALTERNATIVES that does, else FILES' path (reading it
    then names it); an OPTIONAL file found nowhere is None."""
    d = pathlib.Path(folder)
    out = {}
    for key, path in FILES.items():
        found = next((p for pattern in PREFERRED.get(key, [])
                      for p in sorted(d.glob(pattern)) if p.is_file()), None)
        found = found or (d / path if (d / path).is_file() else None)
        for pattern in ALTERNATIVES.get(key, []) if found is None else []:
            hits = sorted(p for p in d.glob(pattern) if p.is_file())
            if hits:
                found = hits[0]
                break
        out[key] = found if found or key in OPTIONAL else d / path
    return out


def load_run(folder):
    """Every fact of a run folder the CUDA section shows; LogError on the first log that lacks
    one."""
    d = pathlib.Path(folder)
    f = files_of(d)
    run = {"folder": d, "files": f,
           "commit": readme_commit(f["readme"]), "report": report_md(f["report"]),
           "driver": smi_driver(f["smi"]), "big": stage_log(f["big"]),
           "copy": gbench_console(f["copy"]), "gemm": gbench_console(f["gemm"]),
           "attention": gbench_console(f["attention"]), "sdpa": sdpa_log(f["sdpa"]),
           "torch": torch_log(f["torch"]),
           "ncu": ncu_summary(f["ncu"]) if f["ncu"] else None}
    if run["driver"] != run["report"]["driver"]:
        raise LogError(f"{f['smi']}: driver {run['driver']}, but {f['report']} says "
                       f"{run['report']['driver']}")
    names = {run[k]["device"]["name"] for k in ("big", "copy", "gemm", "attention")}
    names |= {run["sdpa"]["device"], run["report"]["device"]}
    if len(names) != 1:
        raise LogError(f"{d}: the logs name more than one device: {', '.join(sorted(names))}")
    return run


# --- numbers derived from the logs --------------------------------------------------------------

def gemm_rows(run, dtype="bf16"):
    """bench_gemm's cuda rows of one dtype: [{gemm, m, n, k, us, tflops, timer}]."""
    out = []
    for r in run["gemm"]["rows"]:
        parts = r["name"].split("/")
        if parts[:3] == ["gemm", "cuda", dtype]:
            c = r["counters"]
            out.append({"gemm": "/".join(parts[3:]), "m": int(c["m"]), "n": int(c["n"]),
                        "k": int(c["k"]), "us": r["time_ms"] * 1e3, "tflops": c["TFLOP/s"],
                        "timer": r["timer"]})
    return out


S2_BASE = 2048  # the sequence length the S² scaling is measured from


def attention_rows(run):
    """[{kernel, seq, ms, tflops, peak_mib, vs_sdpa}] at every S both logs have, kernels in the
    order fused, naive, sdpa."""
    sdpa = {r["seq"]: r for r in run["sdpa"]["rows"] if r["head_dim"] == 128}
    rows = []
    for r in run["attention"]["rows"]:
        m = re.fullmatch(r"attention/cuda/bf16/(\w+)/S:(\d+)", r["name"])
        if not m:
            continue
        seq = int(m.group(2))
        if seq not in sdpa:
            raise LogError(f"{run['files']['sdpa']}: no SDPA row at S {seq}, which "
                           f"{run['files']['attention'].name} has")
        rows.append({"kernel": m.group(1), "seq": seq, "ms": r["time_ms"],
                     "tflops": r["counters"]["TFLOP/s"], "peak_mib": r["counters"]["peak_MiB"],
                     "shape": {k: int(r["counters"][k]) for k in ("B", "NH", "D")},
                     "timer": r["timer"]})
    for seq, s in sdpa.items():
        shape = next((r["shape"] for r in rows if r["seq"] == seq), None)
        rows.append({"kernel": "sdpa", "seq": seq, "ms": s["time_ms"], "tflops": s["tflops"],
                     "peak_mib": None, "shape": shape, "timer": "manual"})
    order = {"fused": 0, "naive": 1, "sdpa": 2}
    rows.sort(key=lambda r: (r["seq"], order.get(r["kernel"], 3)))
    # S² scaling: the time over the same kernel's at S 2048 scaled by (S / 2048)², 1 when the
    # work is the kernels' (their FLOPs grow as S²); well above 1 below S 2048 when launches or
    # the host set the time, so a ratio there is not a kernel ratio.
    base = {r["kernel"]: r["ms"] for r in rows if r["seq"] == S2_BASE}
    for r in rows:
        r["vs_sdpa"] = r["ms"] / sdpa[r["seq"]]["time_ms"]
        b = base.get(r["kernel"])
        r["s2_scaling"] = r["ms"] / (b * (r["seq"] / S2_BASE) ** 2) if b else None
    return rows


def copy_rows(run, dtype="bf16"):
    """bench_copy_overlap's rows of one dtype: [{mover, size, slowdown, gemm_ms, copy_GBps,
    copy_alone_GBps}]."""
    out = []
    for r in run["copy"]["rows"]:
        m = re.fullmatch(rf"copy_overlap/cuda/{dtype}/(\w+)/(\d+)", r["name"])
        if m:
            c = r["counters"]
            out.append({"mover": m.group(1), "size": int(m.group(2)), "slowdown": c["slowdown"],
                        "gemm_ms": c["gemm_ms"], "copy_GBps": c["copy_GBps"],
                        "copy_alone_GBps": c["copy_alone_GBps"]})
    if not out:
        raise LogError(f"{run['files']['copy']}: no copy_overlap/cuda/{dtype}/… rows")
    return out


def model_attention_efficiency(tflops_bench, peak_flops, heads, head_dim, hidden):
    """A measured attention rate as the projection model uses it: the model counts attention's
    FLOPs as common/flops.h does (forward 4·B·S²·H, no causal halving, a step 3 × forward) while
    the benches count FlashAttention-2's causal 3.5 · 4·B·NH·S²·D / 2; so the model's FLOPs per
    measured second, over the bf16 peak, is (12·H) / (7·NH·D) × the bench's TFLOP/s / peak."""
    return 12.0 * hidden / (7.0 * heads * head_dim) * tflops_bench * 1e12 / peak_flops


def measured_block(run, peak_bf16_flops, where):
    """The device file's "measured" block from a run: the bf16 GEMM efficiency points (achieved /
    the datasheet peak, at 2·m·n·k; one point per FLOPs, the mean of the rows there; and the
    stage's own 8192³ peak GEMM) and the attention rates of each kernel against S."""
    by_flops = {}
    for g in gemm_rows(run):
        by_flops.setdefault(2.0 * g["m"] * g["n"] * g["k"], []).append(
            g["tflops"] * 1e12 / peak_bf16_flops)
    big = run["big"]
    m = re.search(r"(\d+)\^3", big["peak_how"])
    if not m:
        raise LogError(f"{run['files']['big']}: the peak's note does not say its GEMM's size")
    n = int(m.group(1))
    by_flops.setdefault(2.0 * n ** 3, []).append(big["peak_tflops"] * 1e12 / peak_bf16_flops)
    points = [[f, round(sum(v) / len(v), 4)] for f, v in sorted(by_flops.items())]
    kernels = {}
    for r in attention_rows(run):
        s = r["shape"]
        eff = model_attention_efficiency(r["tflops"], peak_bf16_flops, s["NH"], s["D"],
                                         s["NH"] * s["D"])
        kernels.setdefault(r["kernel"], []).append([r["seq"], round(eff, 4)])
    rel = where.rstrip("/")
    date = run["report"]["date"]
    src = (f"measured on {big['device']['name']} ({big['device']['arch']}, "
           f"{big['device']['sms']} SMs), driver {run['driver']}, {date}, commit {run['commit']}")
    return {
        "source": src,
        "gemm_efficiency": {
            "what": "bf16 GEMM efficiency (achieved / peak_bf16_flops, the datasheet's dense) "
                    "against 2·m·n·k: bench_gemm's cuda bf16 rows (the block's GEMMs at S 2048; "
                    "the mean where several have the same FLOPs) and stage 01's own peak GEMM "
                    f"({n}^3, {big['peak_tflops']} TFLOP/s)",
            "logs": [f"{rel}/{FILES['gemm']}", f"{rel}/{FILES['big']}"],
            "points": points},
        "attention": {
            "what": "each attention kernel's causal forward + backward (B 1, NH 32, D 128, bf16) "
                    "as the model counts it: attention's FLOPs of common/flops.h (no causal "
                    "halving) per measured second, over peak_bf16_flops, against S",
            "logs": [f"{rel}/{FILES['attention']}", f"{rel}/{FILES['sdpa']}"],
            "kernels": {k: {"points": v} for k, v in kernels.items()}}}


def check_device_file(path, run, where, write=False):
    """Compares (or writes) the device file's "measured" block with the run's; returns the
    differences, one line each."""
    text = read(path)
    j = json.loads(text)
    want = measured_block(run, j["peak_bf16_flops"], where)
    have = j.get("measured", {})
    if write:
        keep = {k: v for k, v in have.items() if k not in want}
        j["measured"] = {**keep, **want}
        pathlib.Path(path).write_text(json.dumps(j, indent=2, ensure_ascii=False) + "\n")
        return []
    problems = []
    for key in want:
        if have.get(key) != want[key]:
            problems.append(f"{path}: measured.{key} is not what {where} gives "
                            f"(tools/gpu_logs.py --device-file {path} {where} --write)")
    return problems


# --- the CUDA section ----------------------------------------------------------------------------

MOVERS = {"none": "nothing (GEMM alone)", "copy_engine": "copy engine (cudaMemcpyAsync)",
          "sm_copy": "SM copy kernel", "nccl": "NCCL"}
KERNELS = {"fused": "tpx fused (FlashAttention-2 style)", "naive": "tpx naive (cuBLAS + softmax)",
           "sdpa": "PyTorch SDPA"}


def ratio(r):
    """A time ratio as the page prints it: 3.0× from 2 up, else two decimals (1.15×, 0.89×)."""
    return f"{r:.1f}×" if r >= 2 else f"{r:.2f}×"


def table(head, rows):
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def csv_rows(run):
    """The section's numbers, one a row: part, what, metric, value, unit, log (relative to the run
    folder)."""
    f = {k: str(v.relative_to(run["folder"])) for k, v in run["files"].items() if v}
    big, torch = run["big"], run["torch"]
    rows = [("stage01", "tpx 01_baseline", "step_ms", big["step_ms"], "ms", f["big"]),
            ("stage01", "tpx 01_baseline", "tflops", big["tflop_per_step"] / big["step_ms"] * 1e3,
             "TFLOP/s", f["big"])]
    for mode in ("eager", "compile"):
        rows += [("stage01", f"torch {mode}", "step_ms", torch[mode]["step_ms"], "ms", f["torch"]),
                 ("stage01", f"torch {mode}", "tflops", torch[mode]["tflops"], "TFLOP/s",
                  f["torch"])]
    for r in attention_rows(run):
        log = f["sdpa"] if r["kernel"] == "sdpa" else f["attention"]
        what = f"{r['kernel']} S {r['seq']}"
        rows += [("attention", what, "ms", r["ms"], "ms", log),
                 ("attention", what, "tflops", r["tflops"], "TFLOP/s", log),
                 ("attention", what, "vs_sdpa", r["vs_sdpa"], "x", log)]
        if r["peak_mib"] is not None:
            rows.append(("attention", what, "peak_mib", r["peak_mib"], "MiB", log))
    rows.append(("gemm", "bf16 GEMM peak 8192^3", "tflops", big["peak_tflops"], "TFLOP/s", f["big"]))
    for g in gemm_rows(run):
        what = f"bf16 {g['gemm']} m={g['m']} n={g['n']} k={g['k']}"
        rows += [("gemm", what, "us", g["us"], "us", f["gemm"]),
                 ("gemm", what, "tflops", g["tflops"], "TFLOP/s", f["gemm"])]
    for g in gemm_rows(run, "fp8"):
        what = f"fp8 {g['gemm']} m={g['m']} n={g['n']} k={g['k']}"
        rows += [("gemm", what, "us", g["us"], "us", f["gemm"]),
                 ("gemm", what, "tflops", g["tflops"], "TFLOP/s", f["gemm"])]
    for c in copy_rows(run):
        rows.append(("copy_overlap", f"bf16 {c['mover']} {c['size']}", "slowdown", c["slowdown"],
                     "x", f["copy"]))
    groups, _, _ = ncu_groups(run["ncu"]) if run["ncu"] else ([], None, None)
    for g, n, ms, share in groups:
        rows += [("ncu", g, "launches", n, "", f["ncu"]),
                 ("ncu", g, "ms", ms, "ms", f["ncu"])]
    return rows


def write_csv(run, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["part", "what", "metric", "value", "unit", "log"])
    for part, what, metric, value, unit, log in csv_rows(run):
        w.writerow([part, what, metric, f"{value:.6g}", unit, log])
    path.write_text(out.getvalue())


def plot_attention(run, path):
    """Attention forward + backward time per kernel at each S (log scale): bench_cuda_attention."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams["svg.hashsalt"] = "tpx-bench"
    rows = attention_rows(run)
    seqs = sorted({r["seq"] for r in rows})
    kernels = [k for k in KERNELS if any(r["kernel"] == k for r in rows)]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(kernels)
    for i, k in enumerate(kernels):
        at = {r["seq"]: r["ms"] for r in rows if r["kernel"] == k}  # a kernel may skip an S
        xs = [j + (i - (len(kernels) - 1) / 2) * width for j, s in enumerate(seqs) if s in at]
        ms = [at[s] for s in seqs if s in at]
        bars = ax.bar(xs, ms, width, label=KERNELS[k])
        ax.bar_label(bars, labels=[f"{m:.3g} ms" for m in ms], fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(seqs)), [f"S = {s}" for s in seqs])
    ax.set_ylabel("forward + backward, ms (log scale)")
    dev = run["big"]["device"]
    shape = rows[0]["shape"]
    ax.set_title(f"Causal attention, bf16, B {shape['B']}, NH {shape['NH']}, D {shape['D']}: "
                 f"{dev['name']}, {run['report']['date'][:10]}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(top=ax.get_ylim()[1] * 3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)


def cuda_section(run, where, command, datasheet_tflops, csv_path, figure, latest=True):
    """The CUDA section's markdown (a list of lines) from a loaded run; `where` is the run folder
    as the page names it, `datasheet_tflops` the device file's dense bf16 peak. `latest`: the
    run is the newest published one (its stage 01 sentence says "today", an earlier run's "on
    that run")."""
    big, torch, rep, ncu = run["big"], run["torch"], run["report"], run["ncu"]
    dev = big["device"]
    f = {k: f"{where}/{v.relative_to(run['folder']).as_posix()}"
         for k, v in run["files"].items() if v}
    s = big["sizes"]
    shape = (f"H {s['hidden']} / NH {s['heads']} / F {s['ffn']} / S {s['seq']} / B {s['batch']} / "
             f"L {s['layers']}")
    link = lambda key: f"[{pathlib.PurePath(f[key]).name}]({f[key]})"  # noqa: E731
    out = ["## CUDA", "",
           f"Device: **{dev['name']}, {dev['arch']}, {dev['sms']} SMs** ({dev['memory_gib']} GiB), "
           f"driver {run['driver']} ({link('smi')}). Commit `{run['commit']}` (the run's "
           f"[README]({f['readme']}); "
           + (f"gpu-validate.sh's reports name `{rep['commit']}`, the copy of that tree on the "
              "GPU machine" if rep["commit"] != run["commit"] else "gpu-validate.sh's reports "
              "name it too")
           + f"). Date: {rep['date']} ({link('report')}). One GPU: "
           "the ranks of a multi-rank run share it, so no number here shows scaling across GPUs, "
           "and the stage sweep of the CPU section has not been run on a GPU yet.", "",
           f"Published from the logs of [{where}]({where}) by `{command}`: nothing was run to "
           "write this section, every number is parsed from the log named beside it "
           f"(`tools/gpu_logs.py`), and the numbers are in [{csv_path.name}]"
           f"(benchmarks/{csv_path.name}).", ""]

    # One FLOP count for the three rows: torch_block_perf.py's model FLOPs of the step (the causal
    # attention counted half, as FlashAttention-2 counts it), so their TFLOP/s compare as their
    # times do. The stage's own count (attention as the full S² square, common/flops.h) is
    # quoted beside it.
    eager = torch["eager"]["step_ms"]
    model_tflop = torch["eager"]["tflops"] * eager / 1e3
    tpx_tflops = model_tflop / big["step_ms"] * 1e3
    own_tflops = big["tflop_per_step"] / big["step_ms"] * 1e3
    out += [f"### Stage 01 against PyTorch on the same GPU", "",
            f"One training step of one block, {big['dtype']}, {shape}, SGD "
            f"({link('big')}: mean of steps {big['steps']}, step 0 warms up; {link('torch')}: "
            f"{torch['eager']['what']}). TFLOP/s: the step's model FLOPs, {model_tflop:.3f} "
            "TFLOP, the causal attention counted half (FlashAttention-2's convention), over each "
            "program's time; tpx's own count, attention as the full S² square "
            f"(`common/flops.h`), is {big['tflop_per_step']} TFLOP, {own_tflops:.1f} TFLOP/s.",
            ""]
    rows = [[f"tpx {big['stage']} ({big['attention']} attention)", f"{big['step_ms']:.2f}",
             f"{tpx_tflops:.1f}", ratio(big['step_ms'] / eager)]]
    for mode in ("eager", "compile"):
        t = torch[mode]
        rows.append([f"PyTorch {mode}" if mode == "eager" else "torch.compile",
                     f"{t['step_ms']:.2f}", f"{model_tflop / t['step_ms'] * 1e3:.1f}",
                     f"{t['step_ms'] / eager:.2f}×"])
    out += table(["program", "ms per step", "TFLOP/s (model FLOPs)", "time vs PyTorch eager"],
                 rows)
    when = "today" if latest else "on that run"

    def against(ms, name):  # "3.0× slower than X", or "faster than X" and "0.89× its time"
        r = big["step_ms"] / ms
        return (f"{ratio(r)} slower than {name}", None) if r >= 1 else \
            (f"faster than {name}", f"{ratio(r)} its time")
    head, note = against(eager, "PyTorch eager")
    compiled, compiled_note = against(torch["compile"]["step_ms"], "torch.compile")
    notes = [n for n in (note, compiled + (f", {compiled_note}" if compiled_note else "")) if n]
    out += ["", f"**tpx is {head} {when}** ({'; '.join(notes)}): "
            f"{tpx_tflops:.0f} TFLOP/s is {tpx_tflops / big['peak_tflops'] * 100:.1f} % of the "
            f"{big['peak_tflops']} TFLOP/s bf16 GEMM peak the stage measured before its steps "
            f"({big['peak_how']})."
            + (" Where the time goes is below: mostly attention." if ncu else ""), ""]

    att = attention_rows(run)
    a0 = att[0]["shape"]
    out += ["### Attention, forward + backward", "",
            f"Causal, bf16, B {a0['B']}, NH {a0['NH']}, D {a0['D']} ({link('attention')}, "
            f"{link('sdpa')}: PyTorch {run['sdpa']['torch']}; "
            + ("tpx's rows: bf16 tensors in and out, the calls alone timed by CUDA events, as "
               "SDPA's" if all(r["timer"] == "manual" for r in att) else
               "tpx's rows: fp32 tensors, so each timed iteration also casts q, k, v and dO to "
               "bf16 and the outputs back, and waits on the host; SDPA's: bf16, CUDA events")
            + "). TFLOP/s as the benches count "
            "FLOPs (FlashAttention-2's: 3.5 × the causal forward's 4·B·NH·S²·D / 2); peak MiB: "
            "the allocator's high-water mark above the inputs (tpx's kernels only). S² scaling: "
            f"the time over the same kernel's at S {S2_BASE} times (S / {S2_BASE})², the FLOPs' "
            "growth; below 1 the kernel runs at a higher rate than at S 2048 (fuller waves, "
            "shorter tails), well above 1 something besides the kernels sets the time "
            "(launches, the host), and that row's ratio to SDPA is not a kernel ratio.", ""]
    out += table(["kernel", "S", "ms", "TFLOP/s", "time vs SDPA", "S² scaling", "peak MiB"],
                 [[KERNELS[r["kernel"]], r["seq"], f"{r['ms']:.3g}", f"{r['tflops']:.1f}",
                   f"{r['vs_sdpa']:.1f}×",
                   "—" if r["s2_scaling"] is None else f"{r['s2_scaling']:.2f}",
                   "—" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"] for r in att])
    out += ["", f"![attention time per kernel]({figure})", ""]

    gemms = gemm_rows(run)
    lo, hi = min(g["tflops"] for g in gemms), max(g["tflops"] for g in gemms)
    # bench_gemm's rows became event-timed (manual_time) when its bf16 rows got bf16 operands;
    # before, each timed iteration also cast both fp32 operands to bf16.
    timed = ("bf16 in and out, the product alone timed by CUDA events"
             if all(g["timer"] == "manual" for g in gemms) else
             "bf16 products of fp32 operands: each timed iteration also casts both to bf16, so "
             "these rows understate the GEMMs")
    out += ["### The block's bf16 GEMMs (bench_gemm)", "",
            f"cuBLASLt, {timed}; the GEMMs of the block at S {s['seq']} ({link('gemm')}): "
            f"{lo:.0f}–{hi:.0f} TFLOP/s, {lo / big['peak_tflops'] * 100:.0f}–"
            f"{hi / big['peak_tflops'] * 100:.0f} % of the measured {big['peak_tflops']} TFLOP/s "
            f"peak ({datasheet_tflops:.1f} is the datasheet's dense bf16).", ""]
    out += table(["GEMM", "m", "n", "k", "µs", "TFLOP/s", "% of measured peak",
                  "% of datasheet"],
                 [[g["gemm"], g["m"], g["n"], g["k"], f"{g['us']:.0f}", f"{g['tflops']:.1f}",
                   f"{g['tflops'] / big['peak_tflops'] * 100:.1f}",
                   f"{g['tflops'] / datasheet_tflops * 100:.1f}"] for g in gemms])
    fp8 = gemm_rows(run, "fp8") + gemm_rows(run, "e4m3")
    if not fp8:
        why = (f"the program stopped at its first FP8 case: `{run['gemm']['aborted']}`"
               if run["gemm"]["aborted"] else "the log has none")
        after = (" What has changed since is in [gpu-validation.md](gpu-validation.md); the FP8 "
                 + ("rows come with the next GPU run." if latest else
                    "rows of a later run are in its subsection above.")
                 if run["gemm"]["aborted"] else "")
        out += ["", f"No FP8 rows: {why}.{after}", ""]
    else:
        flo, fhi = min(g["tflops"] for g in fp8), max(g["tflops"] for g in fp8)
        bf16 = {g["gemm"]: g for g in gemms}
        out += ["", f"The same GEMMs in FP8 as stage 06 multiplies them (cuBLASLt; forward "
                f"E4M3 × E4M3, dx E5M2 × E4M3, dW E4M3 × E5M2; {link('gemm')}): "
                f"{flo:.0f}–{fhi:.0f} TFLOP/s; time vs bf16: the bf16 row's time over the FP8 "
                "row's.", ""]
        out += table(["GEMM", "m", "n", "k", "µs", "TFLOP/s", "time vs bf16"],
                     [[g["gemm"], g["m"], g["n"], g["k"], f"{g['us']:.0f}", f"{g['tflops']:.1f}",
                       f"{bf16[g['gemm']]['us'] / g['us']:.2f}×" if g["gemm"] in bf16 else "—"]
                      for g in fp8])
        out += [""]

    cps = copy_rows(run)
    sizes = sorted({c["size"] for c in cps})
    out += ["### A GEMM beside a copy (bench_copy_overlap)", "",
            f"A bf16 GEMM m = n = k while a copy of the same size runs beside it on the same GPU "
            f"({link('copy')}); slow-down = the GEMM's time beside the copy / alone.", ""]
    body = []
    for mover in [m for m in MOVERS if any(c["mover"] == m for c in cps)]:
        row = [MOVERS[mover]]
        for n in sizes:
            c = next((c for c in cps if c["mover"] == mover and c["size"] == n), None)
            row += ["—", "—"] if c is None else [
                f"{c['slowdown']:.2f}×", "—" if not c["copy_GBps"] else
                f"{c['copy_GBps']:.0f} (alone {c['copy_alone_GBps']:.0f})"]
        body.append(row)
    head = ["copy by"]
    for n in sizes:
        head += [f"slow-down, {n}³", f"copy GB/s, {n}³"]
    out += table(head, body)
    at = sizes[0]
    sl = {c["mover"]: c["slowdown"] for c in cps if c["size"] == at}
    out += ["", f"At {at}³ the GEMM runs {sl.get('copy_engine', 0):.2f}× as long beside a "
            f"copy-engine copy, {sl.get('sm_copy', 0):.2f}× beside an SM copy kernel and "
            f"{sl.get('nccl', 0):.2f}× beside NCCL: the copy engine takes no SMs, which is "
            "chapter 5's claim.", ""]

    out += ncu_lines(run, att, link) if ncu else []
    out += ["### Caveats", "",
            "- One GPU: the multi-rank stages ran with their ranks sharing it, so their times "
            "show time-slicing, not scaling, and are not published here.",
            "- The Google Benchmark library on that machine was a debug build (its logs warn). "
            "The rows time GPU work that each iteration waits for (real_time) or CUDA events "
            "(manual_time), so the library's own code is not what they measure.",
            f"- Every number has its log; [{where}/README.md]({where}/README.md) says what ran "
            "and what failed."]
    return out


def ncu_lines(run, att, link):
    """The Nsight Compute subsection of the CUDA section: stage 01's kernel time by group."""
    big, ncu, s = run["big"], run["ncu"], run["big"]["sizes"]
    groups, attn, total = ncu_groups(ncu)
    fused = next((r for r in att if r["kernel"] == big["attention"] and r["seq"] == s["seq"]),
                 None)
    if fused is None:
        raise LogError(f"{run['files']['attention']}: no {big['attention']} row at S {s['seq']}, "
                       "the stage's")
    st = ncu["stage"]
    out = ["### Where stage 01's time goes (Nsight Compute)", "",
            f"{st['stage']} at the same shape under Nsight Compute ({link('ncu')}: "
            f"gpu__time_duration of every launch, serialised and with the profiler's clocks): "
            f"{ncu['launches']} launches profiled, from the middle of step 0 through step 1 of "
            f"its {ncu['steps']} steps, {total:.1f} ms of kernel time in all; the shares are of "
            "that. Each attention kernel runs once per step and layer.", ""]
    out += table(["kernels", "launches", "ms", "share"],
                 [[g, n, f"{ms:.2f}", f"{share * 100:.1f} %"] for g, n, ms, share in groups])
    out += ["", "The attention kernels, per launch: " + ", ".join(
        f"`{k}` {ms:.2f} ms" for k, n, ms in sorted(attn, key=lambda a: -a[2]))
        + f": {sum(ms for _, _, ms in attn):.1f} ms a step under the profiler (bench_attention, "
        f"unprofiled, S {s['seq']}: {fused['ms']:.3g} ms), against {big['step_ms']:.2f} ms for the whole step "
        "unprofiled.", ""]
    return out


NUMBERS = {2: "Two", 3: "Three", 4: "Four"}


def run_heading(run, latest):
    """A run's subsection heading on a page of several runs: its GPU and date."""
    return (f"### {run['big']['device']['name']} ({run['report']['date']}, "
            f"{'the latest run' if latest else 'an earlier run'})")


def runs_side_by_side(runs, wheres, command):
    """The head of a CUDA section of several runs (newest first): what they are, and one table of
    their main numbers, a column per run, each headed by its GPU."""
    names = [r["big"]["device"]["name"] for r in runs]
    csvs = ["cuda_run.csv"] + [f"cuda_run.{pathlib.PurePath(w).name}.csv" for w in wheres[1:]]
    out = ["## CUDA", "",
           f"{NUMBERS.get(len(runs), len(runs))} GPU runs, newest first, each on one GPU: "
           + "; ".join(f"{n} ([{w}]({w}), commit `{r['commit']}`)"
                       for n, w, r in zip(names, wheres, runs))
           + ". "
           + ("They are different GPUs, and each ran the code of its day: a difference between "
              "two columns below is the GPU's and the code's together, not a speed-up of tpx "
              "alone. The comparison that holds is within a run: tpx beside PyTorch on the same "
              "GPU, in each run's subsection." if len(set(names)) > 1 else
              "Each ran the code of its day: a difference between two columns below is the "
              "code's and the machine's together."), "",
           f"Published by `{command}`: nothing was run to write this section, every number is "
           "parsed from the log its run's subsection names (`tools/gpu_logs.py`), and the "
           "numbers are in " + ", ".join(f"[{c}](benchmarks/{c})" for c in csvs) + ", one per "
           "run in the same order.", "",
           "### The runs side by side", ""]
    head = ["what"] + [f"{n}, {r['report']['date']}" for n, r in zip(names, runs)]
    rows = [["commit"] + [f"`{r['commit']}`" for r in runs]]
    s0 = runs[0]["big"]["sizes"]
    rows.append([f"stage 01, {runs[0]['big']['dtype']}, H {s0['hidden']} / NH {s0['heads']} / "
                 f"F {s0['ffn']} / S {s0['seq']} / B {s0['batch']} / L {s0['layers']}: tpx, ms "
                 "per step"] + [f"{r['big']['step_ms']:.2f}" if r["big"]["sizes"] == s0 else "—"
                                for r in runs])
    for mode, label in (("eager", "PyTorch eager"), ("compile", "torch.compile")):
        rows.append([f"the same block, {label}, ms per step"]
                    + [f"{r['torch'][mode]['step_ms']:.2f}" for r in runs])
    rows.append(["tpx's step time vs PyTorch eager's"]
                + [f"{r['big']['step_ms'] / r['torch']['eager']['step_ms']:.2f}×" for r in runs])
    att = [{(a["kernel"], a["seq"]): a for a in attention_rows(r)} for r in runs]
    keys = sorted({k for a in att for k in a}, key=lambda k: (k[1], list(KERNELS).index(k[0])))
    for kernel, seq in keys:
        rows.append([f"attention fwd + bwd, {KERNELS[kernel]}, S {seq}: ms (TFLOP/s)"]
                    + [f"{a[(kernel, seq)]['ms']:.3g} ({a[(kernel, seq)]['tflops']:.1f})"
                       if (kernel, seq) in a else "—" for a in att])
    rows.append(["bf16 GEMM peak the stage measured (TFLOP/s)"]
                + [f"{r['big']['peak_tflops']}" for r in runs])

    def spread(r, dtype):
        g = gemm_rows(r, dtype)
        if g:
            return f"{min(x['tflops'] for x in g):.0f}–{max(x['tflops'] for x in g):.0f}"
        return "— (stopped at its first FP8 case)" if r["gemm"]["aborted"] else "—"
    rows.append(["the block's bf16 GEMMs, S 2048 (TFLOP/s)"] + [spread(r, "bf16") for r in runs])
    rows.append(["the same GEMMs in FP8 (TFLOP/s)"] + [spread(r, "fp8") for r in runs])
    cps = [{(c["mover"], c["size"]): c for c in copy_rows(r)} for r in runs]
    for mover in ("copy_engine", "sm_copy", "nccl"):
        rows.append([f"GEMM 4096³ slow-down beside a copy by {MOVERS[mover]}"]
                    + [f"{c[(mover, 4096)]['slowdown']:.2f}×" if (mover, 4096) in c else "—"
                       for c in cps])
    out += table(head, rows)
    return out


# --- one run's comparison table, as gpu-validate.sh's bench part prints it -----------------------

SPLIT_ROW = re.compile(r"(?m)^attention/cuda/bf16/(fused|sdpa)-(fwd|bwd)/S:(\d+)"
                       r"(?:/(?:real|manual)_time)?\s.*?"
                       r"\s([0-9.]+) ms\s.*?TFLOP/s=([0-9.]+)")


def split_table(attention_logs, sdpa_logs):
    """The fused kernels' forward and backward apart beside SDPA's (rows fused-fwd, fused-bwd of
    bench_attention, sdpa-fwd, sdpa-bwd of sdpa_bench.py), as markdown lines; none when the
    logs have no such rows (runs before they were timed apart)."""
    found = {}  # (seq, pass) -> {kernel: (ms, tflops)}
    for path in list(attention_logs) + list(sdpa_logs):
        for kernel, p, seq, ms, tflops in SPLIT_ROW.findall(read(path)):
            found.setdefault((int(seq), p), {})[kernel] = (float(ms), float(tflops))
    if not found:
        return []
    out = ["", "The forward and the backward apart (D 128, B 1, NH 32):", "",
           "| S | pass | tpx fused: ms, TFLOP/s | PyTorch SDPA | fused ÷ SDPA (TFLOP/s) |",
           "|---|---|---|---|---|"]
    for (seq, p), k in sorted(found.items(), key=lambda x: (x[0][0], x[0][1] != "fwd")):
        cells = [f"{k[n][0]:.3g} ms, {k[n][1]:.1f}" if n in k else "—" for n in ("fused", "sdpa")]
        ratio = f"{k['fused'][1] / k['sdpa'][1]:.3f}" if "fused" in k and "sdpa" in k else "—"
        out.append(f"| {seq} | {'forward' if p == 'fwd' else 'backward'} | {cells[0]} | "
                   f"{cells[1]} | {ratio} |")
    return out


def compare(logdir):
    """The bench part's own logs (gpu-validate.sh OUTDIR/logs: NN-bench_attention.log,
    NN-sdpa_bench*.log, NN-torch_block_perf.log, NN-01.big.bf16*.log) as one markdown table:
    tpx fused and naive attention beside SDPA at every S and D of the run (TFLOP/s, and each
    kernel's TFLOP/s as a multiple of SDPA's), then stage 01's step beside PyTorch eager and
    compiled. Ratios come from one run on one GPU. A log the run lacks is named, not guessed."""
    d = pathlib.Path(logdir)

    def logs(pattern):
        return sorted(d.glob(pattern))

    out, absent = [], []
    tpx = {}  # (seq, head_dim) -> {kernel: row}
    for path in logs("*-bench_attention.log"):
        for r in gbench_console(path)["rows"]:
            m = re.fullmatch(r"attention/cuda/bf16/(\w+)/S:(\d+)(?:/D:(\d+))?", r["name"])
            if m:
                key = (int(m.group(2)), int(m.group(3) or 128))
                tpx.setdefault(key, {})[m.group(1)] = {"ms": r["time_ms"],
                                                        "tflops": r["counters"]["TFLOP/s"]}
    if not tpx:
        absent.append("bench_attention (no NN-bench_attention.log with cuda rows)")
    for path in logs("*-sdpa_bench*.log"):
        try:
            for r in sdpa_log(path)["rows"]:
                key = (r["seq"], r["head_dim"])
                tpx.setdefault(key, {})["sdpa"] = {"ms": r["time_ms"], "tflops": r["tflops"]}
        except LogError:
            absent.append(f"SDPA ({path.name} has no timings: no PyTorch or no GPU there?)")
    if not logs("*-sdpa_bench*.log"):
        absent.append("SDPA (no NN-sdpa_bench*.log: PyTorch was not there)")

    def cell(k):
        return f"{k['ms']:.3g} ms, {k['tflops']:.1f}" if k else "—"

    out += ["| S | D | tpx fused: ms, TFLOP/s | tpx naive | PyTorch SDPA | fused ÷ SDPA "
            "(TFLOP/s) | naive ÷ SDPA |", "|---|---|---|---|---|---|---|"]
    for (seq, hd), k in sorted(tpx.items()):
        sdpa = k.get("sdpa")

        def ratio(kernel):
            return f"{k[kernel]['tflops'] / sdpa['tflops']:.3f}" if sdpa and k.get(kernel) \
                else "—"
        out.append(f"| {seq} | {hd} | {cell(k.get('fused'))} | {cell(k.get('naive'))} | "
                   f"{cell(sdpa)} | {ratio('fused')} | {ratio('naive')} |")

    out += split_table(logs("*-bench_attention.log"), logs("*-sdpa_bench*.log"))

    steps = logs("*-01.big.bf16*.log")  # the bench part's own run, when big ran too
    step = stage_log(steps[-1]) if steps else None
    torch = None
    for path in logs("*-torch_block_perf.log"):
        try:
            torch = torch_log(path)
        except LogError:
            absent.append(f"PyTorch's step ({path.name} has no timings)")
    if step is None:
        absent.append("stage 01's step (no NN-01.big.bf16*.log)")
    if torch is None and not logs("*-torch_block_perf.log"):
        absent.append("PyTorch's step (no NN-torch_block_perf.log: PyTorch was not there)")
    if step:
        z = step["sizes"]
        out += ["", f"Stage 01, {step['dtype']}, H {z['hidden']} NH {z['heads']} F {z['ffn']} "
                f"S {z['seq']} B {z['batch']} L {z['layers']}, ms per training step:", "",
                "| tpx | PyTorch eager | torch.compile | tpx ÷ eager | tpx ÷ compile |",
                "|---|---|---|---|---|"]
        ms = step["step_ms"]
        ref = [torch[mode]["step_ms"] if torch else None for mode in ("eager", "compile")]
        times = [f"{t:.2f}" if t else "—" for t in ref]
        ratios = [f"{ms / t:.2f}×" if t else "—" for t in ref]
        out.append(f"| {ms:.2f} | {' | '.join(times)} | {' | '.join(ratios)} |")
    for a in absent:
        out.append(f"\nnot in this run: {a}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="The logs of a GPU run, read back.")
    ap.add_argument("folder", nargs="?", help="a run folder (docs/gpu-runs/DATE-GPU)")
    ap.add_argument("--gbench-json", metavar="LOG", help="print LOG as Google Benchmark JSON")
    ap.add_argument("--device-file", metavar="FILE",
                    help="check FILE's measured block against the run folder")
    ap.add_argument("--write", action="store_true", help="with --device-file: write it")
    ap.add_argument("--compare", metavar="LOGDIR",
                    help="print gpu-validate.sh's bench comparison from its OUTDIR/logs")
    a = ap.parse_args(argv)
    try:
        if a.gbench_json:
            print(json.dumps(gbench_json(gbench_console(a.gbench_json)), indent=2))
            return 0
        if a.compare:
            print("\n".join(compare(a.compare)))
            return 0
        if not a.folder:
            ap.error("a run folder is needed")
        run = load_run(a.folder)
        if a.device_file:
            problems = check_device_file(a.device_file, run, a.folder, a.write)
            for p in problems:
                print(f"gpu_logs: {p}", file=sys.stderr)
            return 1 if problems else 0
        print(json.dumps({k: v for k, v in run.items() if k not in ("folder", "files")},
                         indent=2, default=str))
        return 0
    except LogError as e:
        print(f"gpu_logs: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
