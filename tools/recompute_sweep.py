#!/usr/bin/env python3
"""Runs one stage under each --recompute policy and shows what each trades: the saved activations
and the allocator's peak against the forward work done again, as a markdown table on stdout and,
with --svg, a figure of peak memory against extra compute.

The policies: none; selective (RMSNorm and SwiGLU's product made again, no GEMM, no collective);
full on every second layer (--recompute full --recompute-every 2); full. Every number comes from
the runs' own --json summaries: saved_activation_bytes, the steps' peak_bytes, the measured step
time (median of the steps after the first), recompute_flops_per_step_per_rank against
flops_per_step_per_rank, and the steps' recompute_bus_bytes.

Usage: tools/recompute_sweep.py [--build build] [--stage 03_sequence_parallel] [--ranks 2]
                                [--svg FILE] [-- STAGE FLAGS...]
Run from the repository root after scripts/env.sh (mpirun as root, oversubscribed).
"""
import argparse
import json
import math
import pathlib
import statistics
import subprocess
import sys
import tempfile
from xml.sax.saxutils import escape

import tool_errors

POLICIES = [
    ("none", ["--recompute", "none"]),
    ("selective", ["--recompute", "selective"]),
    ("full, every 2nd layer", ["--recompute", "full", "--recompute-every", "2"]),
    ("full", ["--recompute", "full"]),
]
# A Llama-shaped block, small enough for a CPU: GQA with 4 query heads per KV head, F = 3.5 H.
DEFAULT_FLAGS = ["--hidden", "512", "--heads", "8", "--kv-heads", "2", "--ffn", "1792", "--seq",
                 "512", "--batch", "1", "--layers", "4", "--steps", "8"]
MIB = 1024.0 * 1024.0


def run(args, policy_flags, path):
    cmd = ["mpirun", "-np", str(args.ranks), f"{args.build}/bin/{args.stage}", *args.flags,
           *policy_flags, "--json", str(path)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return json.loads(path.read_text())


def summarize(name, j):
    steps = j["steps"]
    later = steps[1:] or steps
    flops = j["flops_per_step_per_rank"]
    return {
        "policy": name,
        "layers": j["recomputed_layers"],
        "saved_mib": j["saved_activation_bytes"] / MIB,
        "peak_mib": max(s["peak_bytes"] for s in steps) / MIB,
        "extra_flops_pct": 100.0 * j["recompute_flops_per_step_per_rank"] / flops,
        "repeated_bus_mib": steps[0]["recompute_bus_bytes"] / MIB,
        "ms": statistics.median(s["ms"] for s in later),
        "device": j["config"]["device"],
    }


def table(rows):
    base_ms = rows[0]["ms"]
    out = ["| policy | layers recomputed | saved activations MiB | peak MiB | recomputed GEMM FLOPs "
           "(% of the model's) | repeated bus MiB | step ms (" + rows[0]["device"] + ") | "
           "step time vs none |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['policy']} | {r['layers']} | {r['saved_mib']:.2f} | {r['peak_mib']:.2f} | "
                   f"{r['extra_flops_pct']:.1f} % | {r['repeated_bus_mib']:.2f} | {r['ms']:.1f} | "
                   f"{100.0 * (r['ms'] / base_ms - 1.0):+.1f} % |")
    return "\n".join(out)


def nice_step(raw):
    """The smallest of 1, 2, 5 × 10^k at least `raw`."""
    k = 10.0 ** math.floor(math.log10(raw))
    return next(m * k for m in (1, 2, 5, 10) if m * k >= raw)


def svg(rows, title):
    """Peak memory (y) against recomputed GEMM FLOPs (x), one labelled point per policy."""
    w, h, left, right, top, bottom = 720, 420, 80, 40, 50, 60
    xs = [r["extra_flops_pct"] for r in rows]
    ys = [r["peak_mib"] for r in rows]
    x_hi = 40.0 if max(xs) <= 36.0 else 10.0 * (int(max(xs) * 1.1 / 10.0) + 1)
    step = nice_step(max(ys) * 1.15 / 5)  # five round-numbered intervals above the highest point
    y_lo, y_hi = 0.0, step * (int(max(ys) * 1.15 / step) + 1)
    n_y = round(y_hi / step)

    def px(x):
        return left + (w - left - right) * x / x_hi

    def py(y):
        return top + (h - top - bottom) * (1.0 - (y - y_lo) / (y_hi - y_lo))

    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
         f'font-family="sans-serif" font-size="13">',
         f'<rect width="{w}" height="{h}" fill="white"/>',
         f'<text x="{w / 2}" y="24" text-anchor="middle" font-size="15">{escape(title)}</text>']
    for i in range(5):  # grid and ticks
        x = x_hi * i / 4
        s.append(f'<line x1="{px(x):.1f}" y1="{top}" x2="{px(x):.1f}" y2="{h - bottom}" '
                 f'stroke="#ddd"/>')
        s.append(f'<text x="{px(x):.1f}" y="{h - bottom + 18}" text-anchor="middle">{x:.0f} %'
                 f'</text>')
    for i in range(n_y + 1):
        y = y_lo + step * i
        s.append(f'<line x1="{left}" y1="{py(y):.1f}" x2="{w - right}" y2="{py(y):.1f}" '
                 f'stroke="#ddd"/>')
        s.append(f'<text x="{left - 8}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    s.append(f'<rect x="{left}" y="{top}" width="{w - left - right}" height="{h - top - bottom}" '
             f'fill="none" stroke="#333"/>')
    s.append(f'<text x="{(left + w - right) / 2}" y="{h - 18}" text-anchor="middle">forward GEMM '
             f'FLOPs done again, % of the model\'s step</text>')
    s.append(f'<text x="20" y="{(top + h - bottom) / 2}" text-anchor="middle" '
             f'transform="rotate(-90 20 {(top + h - bottom) / 2})">peak memory per rank, MiB</text>')
    colors = ["#1f77b4", "#2ca02c", "#ff7f0e", "#d62728"]
    for r, c in zip(rows, colors):
        x, y = px(r["extra_flops_pct"]), py(r["peak_mib"])
        right_half = x > left + (w - left - right) / 2  # label on the side with room
        # A point below another at about the same x takes its label underneath.
        below = any(abs(o["extra_flops_pct"] - r["extra_flops_pct"]) < 3 and
                    o["peak_mib"] > r["peak_mib"] for o in rows)
        s.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="6" fill="{c}"/>')
        s.append(f'<text x="{x - 10 if right_half else x + 10:.1f}" '
                 f'y="{y + 20 if below else y - 10:.1f}" '
                 f'text-anchor="{"end" if right_half else "start"}">{escape(r["policy"])}: '
                 f'{r["peak_mib"]:.1f} MiB</text>')
    s.append("</svg>")
    return "\n".join(s) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--stage", default="03_sequence_parallel")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--svg", help="write the figure to this file")
    ap.add_argument("flags", nargs="*", help="the stage's flags (default: a Llama-shaped block)")
    args = ap.parse_args()
    args.flags = args.flags or DEFAULT_FLAGS
    exe = pathlib.Path(args.build) / "bin" / args.stage
    if not exe.is_file():
        tool_errors.fail(f"no {args.stage} in {exe.parent} (--build names the build directory)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in POLICIES:
            rows.append(summarize(name, run(args, flags, pathlib.Path(tmp) / "run.json")))
    print(f"{args.stage} at N = {args.ranks}, {' '.join(args.flags)}:\n")
    print(table(rows))
    if args.svg:
        title = (f"{args.stage}, N = {args.ranks}: peak memory against recompute "
                 f"({rows[0]['device']} run)")
        pathlib.Path(args.svg).write_text(svg(rows, title))


if __name__ == "__main__":
    tool_errors.run(main, "recompute_sweep")
