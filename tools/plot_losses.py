#!/usr/bin/env python3
"""Plots the loss curves of stage runs (their --json summaries) as an SVG, with a second panel
for each run's relative difference from the first run's loss, step by step.

Usage: tools/plot_losses.py REF.json:LABEL RUN.json:LABEL [...] --title TITLE -o OUT.svg

Only the standard library; the numbers are the summaries' own "loss" of every step.
"""
import argparse
import json
from xml.sax.saxutils import escape

import tool_errors

W, H = 720, 520           # the picture
LEFT, RIGHT = 90, 20      # plot margins
TOP1, H1 = 50, 250        # loss panel
TOP2, H2 = 360, 110       # difference panel
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]


def load(arg):
    path, _, label = arg.partition(":")
    steps = json.load(open(path))["steps"]
    return label or path, [s["loss"] for s in steps]


def ticks(lo, hi, n=5):
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def panel(out, top, height, series, lo, hi, steps, fmt, ylabel, caption=""):
    x = lambda i: LEFT + (W - LEFT - RIGHT) * i / max(steps - 1, 1)
    y = lambda v: top + height - height * (v - lo) / ((hi - lo) or 1)
    out.append(f'<rect x="{LEFT}" y="{top}" width="{W - LEFT - RIGHT}" height="{height}" '
               'fill="none" stroke="#999"/>')
    for v in ticks(lo, hi):
        out.append(f'<line x1="{LEFT - 4}" x2="{LEFT}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#999"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{fmt(v)}</text>')
    # A short vertical label fits beside any panel; a longer one goes above it, horizontally.
    out.append(f'<text x="16" y="{top + height / 2}" transform="rotate(-90 16 {top + height / 2})" '
               f'text-anchor="middle">{escape(ylabel)}</text>')
    if caption:
        out.append(f'<text x="{LEFT}" y="{top - 8}">{escape(caption)}</text>')
    for k, (label, values) in enumerate(series):
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(values))
        dash = ' stroke-dasharray="6 3"' if k > 0 else ""
        out.append(f'<polyline points="{points}" fill="none" stroke="{COLORS[k % 4]}" '
                   f'stroke-width="1.5"{dash}/>')
    for i in ticks(0, steps - 1):
        out.append(f'<text x="{x(i):.1f}" y="{top + height + 16}" text-anchor="middle">{round(i)}</text>')


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="summary.json:label, the first is the reference")
    ap.add_argument("--title", default="loss")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    runs = [load(r) for r in a.runs]
    steps = min(len(v) for _, v in runs)
    runs = [(label, v[:steps]) for label, v in runs]
    ref = runs[0][1]
    diffs = [(label, [(v[i] - ref[i]) / abs(ref[i]) for i in range(steps)]) for label, v in runs[1:]]

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           'font-family="sans-serif" font-size="12">',
           f'<title>{escape(a.title)}</title>',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{escape(a.title)}</text>']
    lo = min(min(v) for _, v in runs)
    hi = max(max(v) for _, v in runs)
    panel(out, TOP1, H1, runs, lo, hi, steps, lambda v: f"{v:.4f}", "loss")
    worst = max((abs(d) for _, v in diffs for d in v), default=0) or 1e-9
    panel(out, TOP2, H2, [("", [0] * steps)] + diffs, -worst, worst, steps, lambda v: f"{v:+.1e}",
          "rel. diff.", "relative difference from " + runs[0][0] + ", step by step")
    out.append(f'<text x="{W / 2}" y="{H - 8}" text-anchor="middle">SGD step</text>')
    for k, (label, _) in enumerate(runs):
        out.append(f'<line x1="{W - 250}" x2="{W - 220}" y1="{TOP1 + 18 + 18 * k}" '
                   f'y2="{TOP1 + 18 + 18 * k}" stroke="{COLORS[k % 4]}" stroke-width="2"/>')
        out.append(f'<text x="{W - 214}" y="{TOP1 + 22 + 18 * k}">{escape(label)}</text>')
    out.append("</svg>")
    with open(a.output, "w") as f:
        f.write("\n".join(out) + "\n")
    for label, v in diffs:
        print(f"{label}: largest |relative difference| {max(abs(d) for d in v):.3e} over {steps} steps")


if __name__ == "__main__":
    tool_errors.run(main, "plot_losses")
