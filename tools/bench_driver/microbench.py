"""The micro-benchmarks' Google Benchmark JSON (bench_gemm's peak, bench_collectives' bus
bandwidth), the machine's load and its device line.
"""
import math
import os
import pathlib
import re


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
