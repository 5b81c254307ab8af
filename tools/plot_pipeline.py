#!/usr/bin/env python3
"""Plots what stage 09's --json "pipeline" object reports over several runs.

  bubble: the measured idle share of the step (bubble_measured) against the number of
          micro-batches M, one colour per schedule, beside the schedule's formula
          (bubble_formula) drawn as a line through the same M.
  live:   the peak number of (micro-batch, layer) activations alive on each pipeline stage
          (live_peak), one group of bars per run, with the run's measured peak memory on
          rank 0 (the last step's peak_bytes) under its label.

Usage: tools/plot_pipeline.py bubble RUN.json [...] --title TITLE -o OUT.svg
       tools/plot_pipeline.py live RUN.json:LABEL [...] --title TITLE -o OUT.svg

Only the standard library; the numbers are the summaries' own.
"""
import argparse
import json
from xml.sax.saxutils import escape

import tool_errors

W, H = 900, 440
LEFT, RIGHT, TOP, BOTTOM = 70, 240, 50, 80
COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def pipeline_of(path):
    j = json.load(open(path))
    if "pipeline" not in j:
        tool_errors.fail(f"no \"pipeline\" object (not a 09_pipeline_parallel --json), {path}")
    return j


def frame(title, y_label, x_label):
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="12">',
           f"<title>{escape(title)}</title>",
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{LEFT}" y="24" font-size="14" font-weight="bold">{escape(title)}</text>',
           f'<text x="18" y="{TOP + (H - TOP - BOTTOM) / 2}" text-anchor="middle" '
           f'transform="rotate(-90 18 {TOP + (H - TOP - BOTTOM) / 2})">{escape(y_label)}</text>',
           f'<text x="{LEFT + (W - LEFT - RIGHT) / 2}" y="{H - BOTTOM + 40}" '
           f'text-anchor="middle">{escape(x_label)}</text>']
    return out


def y_axis(out, top, ticks, fmt):
    plot_h = H - TOP - BOTTOM
    y = lambda v: TOP + plot_h - v / top * plot_h  # noqa: E731
    for i in range(ticks + 1):
        v = top * i / ticks
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                   f'stroke="#eeeeee"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{fmt(v)}</text>')
    return y


def legend(out, entries, y0=TOP):
    for k, (label, colour, dashed) in enumerate(entries):
        y = y0 + 18 * k
        dash = ' stroke-dasharray="5 3"' if dashed else ""
        out.append(f'<line x1="{W - RIGHT + 14}" x2="{W - RIGHT + 34}" y1="{y + 6}" y2="{y + 6}" '
                   f'stroke="{colour}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{W - RIGHT + 40}" y="{y + 10}">{escape(label)}</text>')


def bubble(a):
    series = {}  # schedule (with V) → [(M, measured, formula)]
    for path in a.runs:
        p = pipeline_of(path)["pipeline"]
        name = p["schedule"] + (f" V {p['stages_per_rank']}" if p["stages_per_rank"] > 1 else "")
        series.setdefault(name, []).append(
            (p["microbatches"], p["bubble_measured"], p["bubble_formula"]))  # formula: None
    # where it does not apply (ZB-H1 with M < P)
    ms = sorted({m for pts in series.values() for m, _, _ in pts})
    top = max(max(max(v, f or 0) for _, v, f in pts) for pts in series.values())
    top = min(1.0, (int(top * 10) + 1) / 10)
    out = frame(a.title, "idle share of the step", "micro-batches M (evenly spaced)")
    y = y_axis(out, top, 5, lambda v: f"{v:.2f}")
    plot_w = W - LEFT - RIGHT
    x = lambda m: LEFT + plot_w * (ms.index(m) + 0.5) / len(ms)  # noqa: E731
    for m in ms:
        out.append(f'<text x="{x(m):.1f}" y="{H - BOTTOM + 18}" text-anchor="middle">{m}</text>')
    entries = []
    for k, (name, pts) in enumerate(sorted(series.items())):
        colour = COLOURS[k % len(COLOURS)]
        pts.sort()
        formula = [(m, f) for m, _, f in pts if f is not None]
        if len(formula) > 1:
            path = " ".join(f"{x(m):.1f},{y(f):.1f}" for m, f in formula)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" '
                       f'stroke-width="1.5" stroke-dasharray="5 3"/>')
        path = " ".join(f"{x(m):.1f},{y(v):.1f}" for m, v, _ in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for m, v, f in pts:
            out.append(f'<circle cx="{x(m):.1f}" cy="{y(v):.1f}" r="4" fill="{colour}">'
                       f"<title>{escape(name)} M {m}: measured {v:.3f}, formula "
                       f"{'none' if f is None else f'{f:.3f}'}"
                       f"</title></circle>")
        entries += [(f"{name} measured", colour, False), (f"{name} formula", colour, True)]
    legend(out, entries)
    out.append(f'<text x="{LEFT}" y="{H - 12}" fill="#555">solid: --json bubble_measured '
               f'(idle / wall over the pipeline); dashed: bubble_formula</text>')
    return out


def live(a):
    runs = []
    for arg in a.runs:
        path, _, label = arg.partition(":")
        j = pipeline_of(path)
        runs.append((label or path, j["pipeline"]["live_peak"], j["steps"][-1]["peak_bytes"]))
    stages = max(len(v) for _, v, _ in runs)
    top = max(max(v) for _, v, _ in runs) + 1
    out = frame(a.title, "peak live (micro-batch, stage) activations", "")
    y = y_axis(out, top, top, lambda v: f"{v:.0f}")
    plot_w = W - LEFT - RIGHT
    group = plot_w / len(runs)
    bar = group * 0.7 / stages
    for k, (label, counts, peak) in enumerate(runs):
        x0 = LEFT + group * k + group * 0.15
        for s, c in enumerate(counts):
            colour = COLOURS[s % len(COLOURS)]
            xs = x0 + bar * s
            out.append(f'<rect x="{xs:.1f}" y="{y(c):.1f}" width="{bar - 2:.1f}" '
                       f'height="{y(0) - y(c):.1f}" fill="{colour}"/>')
            out.append(f'<text x="{xs + bar / 2 - 1:.1f}" y="{y(c) - 4:.1f}" '
                       f'text-anchor="middle" font-size="11">{c}</text>')
        cx = LEFT + group * (k + 0.5)
        out.append(f'<text x="{cx:.1f}" y="{H - BOTTOM + 18}" text-anchor="middle">'
                   f"{escape(label)}</text>")
        out.append(f'<text x="{cx:.1f}" y="{H - BOTTOM + 34}" text-anchor="middle" fill="#555" '
                   f'font-size="11">peak {peak / 1048576:.1f} MiB</text>')
    for s in range(stages):
        colour = COLOURS[s % len(COLOURS)]
        out.append(f'<rect x="{W - RIGHT + 16}" y="{TOP + 18 * s}" width="12" height="12" '
                   f'fill="{colour}"/>')
        out.append(f'<text x="{W - RIGHT + 34}" y="{TOP + 18 * s + 10}">pipeline stage {s}'
                   f"</text>")
    out.append(f'<text x="{LEFT}" y="{H - 12}" fill="#555">bars: --json live_peak per stage; '
               f'peak: rank 0\'s measured peak_bytes (stage 0)</text>')
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["bubble", "live"])
    ap.add_argument("runs", nargs="+", help="RUN.json (bubble) or RUN.json:LABEL (live)")
    ap.add_argument("--title", default="pipeline")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    out = bubble(a) if a.kind == "bubble" else live(a)
    out.append("</svg>")
    open(a.output, "w").write("\n".join(out) + "\n")


if __name__ == "__main__":
    tool_errors.run(main, "plot_pipeline")
