#!/usr/bin/env python3
"""Plots what each run's memory estimate is made of (their --json "memory_terms") as stacked
bars, one bar per run, with the allocator's measured peak of the run's last step as a tick beside
each bar: the per-rank memory of stage 07 against D.

Usage: tools/plot_memory.py RUN.json:LABEL [...] --title TITLE -o OUT.svg

Only the standard library; the numbers are the summaries' own.
"""
import argparse
import json
from xml.sax.saxutils import escape

import tool_errors

W, H = 760, 460
LEFT, RIGHT, TOP, BOTTOM = 80, 230, 50, 70
# The terms in stacking order, with their colours; others (if a run has them) are grey.
TERMS = [
    ("parameters", "#1f77b4"), ("gradients", "#aec7e8"), ("optimizer state", "#9467bd"),
    ("bf16 weight copies", "#c5b0d5"), ("saved activations", "#2ca02c"),
    ("unsharded layers (FSDP)", "#ff7f0e"), ("largest temporaries", "#bbbbbb"),
    ("target", "#dddddd"), ("fp32 input", "#eeeeee"),
]


def load(arg):
    path, _, label = arg.partition(":")
    j = json.load(open(path))
    return label or path, j["memory_terms"], j["steps"][-1]["peak_bytes"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="RUN.json:LABEL")
    ap.add_argument("--title", default="memory per rank")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    runs = [load(r) for r in a.runs]
    mib = 1024.0 * 1024.0
    top = max(max(sum(t.values()), peak) for _, t, peak in runs) / mib * 1.1
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM
    y = lambda v: TOP + plot_h - v / top * plot_h  # noqa: E731  (MiB → pixels)
    bar = plot_w / len(runs) * 0.55
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="12">',
           f"<title>{escape(a.title)}</title>",
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{LEFT}" y="24" font-size="14" font-weight="bold">{escape(a.title)}</text>']
    for i in range(6):  # the axis
        v = top * i / 5
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                   f'stroke="#eeeeee"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
    out.append(f'<text x="20" y="{TOP + plot_h / 2}" transform="rotate(-90 20 {TOP + plot_h / 2})" '
               f'text-anchor="middle">MiB per rank</text>')
    known = [n for n, _ in TERMS]
    for k, (label, terms, peak) in enumerate(runs):
        x = LEFT + plot_w / len(runs) * (k + 0.5) - bar / 2
        base = 0.0
        names = [n for n in known if n in terms] + sorted(n for n in terms if n not in known)
        for name in names:
            v = terms[name] / mib
            colour = dict(TERMS).get(name, "#999999")
            out.append(f'<rect x="{x:.1f}" y="{y(base + v):.1f}" width="{bar:.1f}" '
                       f'height="{max(y(base) - y(base + v), 0):.1f}" fill="{colour}">'
                       f"<title>{escape(name)}: {v:.2f} MiB</title></rect>")
            base += v
        out.append(f'<line x1="{x - 6:.1f}" x2="{x + bar + 6:.1f}" y1="{y(peak / mib):.1f}" '
                   f'y2="{y(peak / mib):.1f}" stroke="black" stroke-width="2"/>')
        out.append(f'<text x="{x + bar / 2:.1f}" y="{TOP + plot_h + 18}" text-anchor="middle">'
                   f"{escape(label)}</text>")
        out.append(f'<text x="{x + bar / 2:.1f}" y="{y(max(base, peak / mib)) - 6:.1f}" '
                   f'text-anchor="middle" font-size="11">{base:.1f}</text>')
    ly = TOP
    for name, colour in TERMS:
        if any(name in t for _, t, _ in runs):
            out.append(f'<rect x="{W - RIGHT + 16}" y="{ly}" width="12" height="12" fill="{colour}"/>')
            out.append(f'<text x="{W - RIGHT + 34}" y="{ly + 10}">{escape(name)}</text>')
            ly += 18
    out.append(f'<line x1="{W - RIGHT + 14}" x2="{W - RIGHT + 30}" y1="{ly + 6}" y2="{ly + 6}" '
               f'stroke="black" stroke-width="2"/>')
    out.append(f'<text x="{W - RIGHT + 34}" y="{ly + 10}">measured peak</text>')
    out.append(f'<text x="{LEFT}" y="{H - 16}" fill="#555">bars: the estimate\'s terms (--json '
               f'memory_terms); the number on a bar is its total</text>')
    out.append("</svg>")
    open(a.output, "w").write("\n".join(out) + "\n")


if __name__ == "__main__":
    tool_errors.run(main, "plot_memory")
