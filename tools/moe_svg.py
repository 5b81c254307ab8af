#!/usr/bin/env python3
"""Chapter 10's figures, as SVG with the standard library alone.

    moe_svg.py dispatch -o OUT.svg
        The expert-parallel layer on EP 2 with E 4, K 2 and three tokens per rank: each rank's
        tokens, the rows it sends grouped by destination rank and then by expert (the order of
        common/moe_ep.cc's dispatch), and each rank's experts with the rows they receive, the
        sending rank's first. The routing is a fixed example, the same every time.

    moe_svg.py balance RUN.json:LABEL [...] [--layer I] [--smooth N] -o OUT.svg
        From 10_expert_parallel --json summaries: per step, the busiest expert's assignments over
        the mean (max / mean of "tokens_per_expert" of MoE layer I: 1 is perfect balance),
        averaged over N steps, one line per run.
"""
import argparse
import json
from xml.sax.saxutils import escape

import tool_errors

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
EXPERT_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1"]

# The example: EP 2, experts 0-1 on rank 0 and 2-3 on rank 1, tokens t0-t2 on rank 0 and t3-t5
# on rank 1, each token's two experts in the router's order.
ROUTES = {0: (0, 2), 1: (1, 0), 2: (3, 2), 3: (2, 1), 4: (0, 3), 5: (2, 0)}
EP, EXPERTS, TOKENS_PER_RANK = 2, 4, 3


def owner(e):
    return e // (EXPERTS // EP)


def box(out, x, y, w, h, fill, text, stroke="#333", font=12):
    out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="3" fill="{fill}" '
               f'stroke="{stroke}"/>')
    out.append(f'<text x="{x + w / 2}" y="{y + h / 2 + 4}" text-anchor="middle" '
               f'font-size="{font}">{escape(text)}</text>')


def arrow(out, x1, y1, x2, y2, color="#888"):
    out.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{color}" '
               'stroke-width="1.2" marker-end="url(#head)"/>')


def dispatch(a):
    W, H = 900, 560
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           'font-family="sans-serif" font-size="12">',
           '<title>stage 10: dispatch and combine on EP 2, E 4, K 2 (an example routing)</title>',
           '<defs><marker id="head" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" '
           'markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#888"/></marker>'
           '</defs>',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="24" text-anchor="middle" font-size="15">Expert parallelism: '
           'each token\'s row goes to the ranks of its K experts and comes back</text>']
    cols = {"tokens": 40, "send": 300, "experts": 600}
    for name, x, text in (("tokens", cols["tokens"], "tokens, router: top-2 of 4"),
                          ("send", cols["send"], "sent: by destination, then expert"),
                          ("experts", cols["experts"], "received, and each expert")):
        out.append(f'<text x="{x}" y="56" font-weight="bold">{escape(text)}</text>')
    row_h, gap = 22, 4
    token_y, send_y, recv_y = {}, {}, {}
    for r in range(EP):
        top = 80 + r * 240
        out.append(f'<rect x="20" y="{top - 14}" width="{W - 40}" height="224" rx="6" '
                   'fill="#f7f7f7" stroke="#ccc"/>')
        out.append(f'<text x="28" y="{top - 1}" fill="#555">EP rank {r}</text>')
        # Its tokens, with their two experts.
        for i in range(TOKENS_PER_RANK):
            t = r * TOKENS_PER_RANK + i
            y = top + 10 + i * (row_h + gap) * 2
            box(out, cols["tokens"], y, 60, row_h, "#ffffff", f"x t{t}")
            for j, e in enumerate(ROUTES[t]):
                ey = y + j * (row_h - 4) - 4
                out.append(f'<text x="{cols["tokens"] + 68}" y="{ey + 14}" '
                           f'fill="{EXPERT_COLORS[e]}">→ e{e} (w{j})</text>')
            token_y[t] = y + row_h / 2
        # What it sends: by destination rank, then by expert, then token order.
        y = top + 4
        for d in range(EP):
            out.append(f'<text x="{cols["send"] - 8}" y="{y + 14}" text-anchor="end" '
                       f'fill="#555">to {d}</text>')
            for e in range(d * EXPERTS // EP, (d + 1) * EXPERTS // EP):
                for i in range(TOKENS_PER_RANK):
                    t = r * TOKENS_PER_RANK + i
                    if e in ROUTES[t]:
                        box(out, cols["send"], y, 150, row_h - 4, EXPERT_COLORS[e] + "33",
                            f"x t{t} for e{e}", stroke=EXPERT_COLORS[e], font=11)
                        arrow(out, cols["tokens"] + 60, token_y[t], cols["send"], y + 9)
                        send_y[(t, e)] = y + 9
                        y += row_h - 2
            y += 8
    # Each rank's experts and the rows they receive: from rank 0 first, then rank 1.
    for d in range(EP):
        top = 80 + d * 240
        y = top + 4
        for e in range(d * EXPERTS // EP, (d + 1) * EXPERTS // EP):
            first = y
            for s in range(EP):
                for i in range(TOKENS_PER_RANK):
                    t = s * TOKENS_PER_RANK + i
                    if e in ROUTES[t]:
                        box(out, cols["experts"], y, 110, row_h - 4, "#ffffff",
                            f"x t{t} (from {s})", stroke=EXPERT_COLORS[e], font=11)
                        arrow(out, cols["send"] + 150, send_y[(t, e)], cols["experts"], y + 9,
                              EXPERT_COLORS[e])
                        y += row_h - 2
            box(out, cols["experts"] + 130, first, 120, y - first - 2, EXPERT_COLORS[e] + "22",
                f"expert e{e}: SwiGLU", stroke=EXPERT_COLORS[e])
            y += 10
    out.append(f'<text x="{W / 2}" y="{H - 30}" text-anchor="middle">all_to_all_v over the EP '
               'group (the counts per expert first); combine is the reverse all_to_all_v, and '
               'each token\'s rank sums</text>')
    out.append(f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">y_t = w0 · e(x_t) + w1 · '
               'e\'(x_t), the gate weights renormalised over the two (a dropped row counts 0)'
               '</text>')
    out.append("</svg>")
    with open(a.output, "w") as f:
        f.write("\n".join(out) + "\n")


def balance(a):
    runs = []
    for arg in a.runs:
        path, _, label = arg.partition(":")
        summary = json.load(open(path))
        if "moe" not in summary:
            tool_errors.fail(f"no \"moe\" object (not a 10_expert_parallel --json), {path}")
        counts = summary["moe"].get("tokens_per_expert")
        if not isinstance(counts, list) or not counts:
            tool_errors.fail(f"{path}: moe.tokens_per_expert holds no step")
        if any(not isinstance(step, list) for step in counts) or a.layer >= len(counts[0]):
            tool_errors.fail(f"{path} has {len(counts[0])} MoE layers, not layer {a.layer}")
        ratio = []
        for s, step in enumerate(counts):
            layer = step[a.layer] if a.layer < len(step) else None
            if (not isinstance(layer, list) or not layer or
                    any(not isinstance(n, (int, float)) or n < 0 for n in layer) or sum(layer) <= 0):
                tool_errors.fail(f"{path}: moe.tokens_per_expert[{s}][{a.layer}] is not a list of "
                                 "counts with at least one assignment")
            ratio.append(max(layer) / (sum(layer) / len(layer)))
        n = max(1, a.smooth)
        smooth = [sum(ratio[max(0, i - n + 1):i + 1]) / len(ratio[max(0, i - n + 1):i + 1])
                  for i in range(len(ratio))]
        runs.append((label or path, smooth, summary["moe"]["experts"]))
    steps = min(len(v) for _, v, _ in runs)
    W, H, LEFT, RIGHT, TOP, PH = 720, 420, 70, 20, 50, 300
    lo, hi = 1.0, max(max(v[:steps]) for _, v, _ in runs) * 1.05
    x = lambda i: LEFT + (W - LEFT - RIGHT) * i / max(steps - 1, 1)
    y = lambda v: TOP + PH - PH * (v - lo) / ((hi - lo) or 1)
    title = (f"stage 10: the busiest expert's load over the mean, MoE layer {a.layer}, "
             f"E {runs[0][2]} ({a.smooth}-step mean; cpu backend runs)")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           'font-family="sans-serif" font-size="12">', f'<title>{escape(title)}</title>',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="13">{escape(title)}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - RIGHT}" height="{PH}" fill="none" '
           'stroke="#999"/>']
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        out.append(f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                   'stroke="#eee"/>')
    for k in range(5):
        i = (steps - 1) * k / 4
        out.append(f'<text x="{x(i):.1f}" y="{TOP + PH + 16}" text-anchor="middle">{round(i)}'
                   '</text>')
    out.append(f'<text x="{W / 2}" y="{TOP + PH + 36}" text-anchor="middle">step</text>')
    out.append(f'<text x="16" y="{TOP + PH / 2}" transform="rotate(-90 16 {TOP + PH / 2})" '
               'text-anchor="middle">max / mean tokens per expert</text>')
    for k, (label, v, _) in enumerate(runs):
        points = " ".join(f"{x(i):.1f},{y(val):.1f}" for i, val in enumerate(v[:steps]))
        out.append(f'<polyline points="{points}" fill="none" stroke="{COLORS[k % 5]}" '
                   'stroke-width="1.6"/>')
        out.append(f'<line x1="{W - 270}" x2="{W - 240}" y1="{TOP + 18 + 18 * k}" '
                   f'y2="{TOP + 18 + 18 * k}" stroke="{COLORS[k % 5]}" stroke-width="2"/>')
        out.append(f'<text x="{W - 234}" y="{TOP + 22 + 18 * k}">{escape(label)}</text>')
        tail = v[steps - steps // 4:steps] or v[:steps]
        print(f"{label}: max/mean over the last quarter of the steps {sum(tail) / len(tail):.3f}")
    out.append("</svg>")
    with open(a.output, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="figure", required=True)
    d = sub.add_parser("dispatch")
    d.add_argument("-o", "--output", required=True)
    b = sub.add_parser("balance")
    b.add_argument("runs", nargs="+", help="summary.json:label")
    b.add_argument("--layer", type=int, default=0)
    b.add_argument("--smooth", type=int, default=10)
    b.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    if a.figure == "dispatch":
        dispatch(a)
    else:
        if a.layer < 0 or a.smooth < 1:
            tool_errors.fail("--layer must be >= 0 and --smooth >= 1")
        balance(a)


if __name__ == "__main__":
    tool_errors.run(main, "moe_svg")
