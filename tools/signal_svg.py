#!/usr/bin/env python3
"""Draws stage 05's signal protocol from a real run: who writes which ready / done counter when.

The input is a --trace file of 05_copy_engine_async_tp (or 06_fp8). The trace records spans, not
the signals themselves, but every signal is issued on a lane right after a span of that lane, in
stream order (05_copy_engine_async_tp/copy_engine.cc), so its time is the end of that span:

  all-gather, rank p, use k of its `ag` buffer:
    '<role> publish' (copy lane) ends      -> ready = k written into every peer's pad
    '<role> pull j/N-1' (copy lane) ends   -> done = k written into the pad of the rank pulled from
                                              (rank r pulls from r + j)
  reduce-scatter, rank p, use k of its `rs` buffer:
    '<role> GEMM step i/N' (compute) ends  -> ready = k written into the pad of the chunk's owner
                                              (chunk (p + i) mod N; the last step is p's own: none)
    '<role> pull j/N-1' (copy lane) ends   -> done = k written into the pad of the rank pulled from
                                              (rank r pulls from r − j)

and the wait before each pull is the gap between the ready signal it needs and the pull's start.
The generation k is counted from the trace: the number of uses of that buffer on that rank so far
(a gather publishes once per use; a reduce-scatter adds its first landing once per use), which is
exact for a trace that starts with the run, as --trace does.

The SVG has two panels, the all-gather of --ag ROLE and the reduce-scatter of --rs ROLE in the
forward of step --step, each with a compute and a copy row per rank, the spans of that role, and
an arrow per signal: ready (producer -> consumer) solid, done (consumer -> producer) dashed.
--text prints the same signals as a table, in time order.

    python3 tools/signal_svg.py t05.json --step 1 --ag qkv --rs o -o docs/figures/05_signals_np3.svg

Python 3 standard library only.
"""

import argparse
import os
import re
import sys
from xml.sax.saxutils import escape

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tool_errors  # noqa: E402  (one line and exit 2 on bad input)
import trace_svg  # noqa: E402  (the trace loader and the step windows)

COMPUTE, COPY = trace_svg.LANE_COMPUTE, trace_svg.LANE_COPY
READY, DONE = "#c0392b", "#1f5fa8"
FILL = {"GEMM": "#4878cf", "publish": "#9fd4d4", "pull": "#2f8f8f", "add": "#a6a6a6"}


def kind(name):
    for k in ("GEMM", "publish", "pull", "add"):
        if k in name:
            return k
    return "add"


def uses_before(spans, rank, t, pattern):
    """How many spans of `rank` matching `pattern` start at or before t: the buffer's use count."""
    rx = re.compile(pattern)
    return sum(1 for e in spans if e["pid"] == rank and rx.search(e["name"]) and e["t0"] <= t)


def first(spans, rank, name, t0, t1):
    hits = [e for e in spans if e["pid"] == rank and e["name"] == name and t0 <= e["t0"] < t1]
    if not hits:
        tool_errors.fail(f"rank {rank} has no span '{name}' in the step's forward")
    return min(hits, key=lambda e: e["t0"])


def gather(spans, ranks, role, t0, t1):
    """The spans drawn and the signals of the first all-gather of `role` in [t0, t1)."""
    n = len(ranks)
    drawn, signals = [], []
    publish = {r: first(spans, r, f"{role} publish", t0, t1) for r in ranks}
    gen = {r: uses_before(spans, r, publish[r]["t0"], r" publish$") for r in ranks}
    for r in ranks:
        drawn.append(publish[r])
        for p in ranks:
            if p != r:
                signals.append(dict(kind="ready", gen=gen[r], src=r, dst=p, t=publish[r]["t1"],
                                    src_lane=COPY, after=publish[r]["name"]))
    for r in ranks:
        start = publish[r]["t0"] - 1.0  # the own chunk's GEMM may start before the publish
        for i in range(1, n + 1):
            drawn.append(first(spans, r, f"{role} GEMM step {i}/{n}", start, t1))
        for j in range(1, n):
            p = (r + j) % n
            pull = dict(first(spans, r, f"{role} pull {j}/{n - 1}", publish[r]["t0"], t1),
                        peer=f"from {p}")
            drawn.append(pull)
            signals.append(dict(kind="done", gen=gen[p], src=r, dst=p, t=pull["t1"], src_lane=COPY,
                                after=pull["name"], wait_lane=COPY))  # p's next publish waits
            for s in signals:
                if s["kind"] == "ready" and s["src"] == p and s["dst"] == r:
                    s["consumer"] = pull
    return drawn, signals


def reduce_scatter(spans, ranks, role, t0, t1):
    """The spans drawn and the signals of the first reduce-scatter of `role` in [t0, t1)."""
    n = len(ranks)
    drawn, signals, gemm = [], [], {}
    for r in ranks:
        gemm[r] = [first(spans, r, f"{role} GEMM step {i}/{n}", t0, t1) for i in range(1, n + 1)]
        drawn += gemm[r]
    for r in ranks:
        start = gemm[r][0]["t0"]
        add1 = first(spans, r, f"{role} add 1/{n - 1}", start, t1)
        k = uses_before(spans, r, add1["t0"], rf" add 1/{n - 1}$")
        for i in range(n - 1):  # step i + 1 writes the slot of chunk (r + i + 1) mod N
            c = (r + i + 1) % n
            signals.append(dict(kind="ready", gen=k, src=r, dst=c, t=gemm[r][i]["t1"],
                                src_lane=COMPUTE, after=gemm[r][i]["name"]))
        for j in range(1, n):
            p = (r - j) % n
            pull = dict(first(spans, r, f"{role} pull {j}/{n - 1}", start, t1), peer=f"from {p}")
            drawn.append(pull)
            signals.append(dict(kind="done", gen=k, src=r, dst=p, t=pull["t1"], src_lane=COPY,
                                after=pull["name"], wait_lane=COMPUTE))  # p's next GEMM waits
        for j in range(1, n):
            drawn.append(first(spans, r, f"{role} add {j}/{n - 1}", start, t1))
    for s in signals:
        if s["kind"] == "ready":
            j = (s["dst"] - s["src"]) % n  # the owner pulls from dst − j: j steps back
            s["consumer"] = next(e for e in drawn if e["pid"] == s["dst"] and e["tid"] == COPY
                                 and e["name"] == f"{role} pull {j}/{n - 1}")
    return drawn, signals


def align(ranks, signals):
    """Per-rank clock shifts (ms) from the protocol's own order.

    Each rank's trace clock starts after the ranks' start-up agreement, so clocks differ by up to
    a few hundred microseconds. A pull cannot start before the ready signal it waited for, so
    shift(r) − shift(p) ≥ ready time on p − pull start on r for every such pair: the least shifts
    that satisfy all of them (longest paths from the slowest clock, Bellman-Ford), 0 for the rank
    that needs none.
    """
    need = {}
    for s in signals:
        if s["kind"] == "ready":
            key = (s["dst"], s["src"])
            need[key] = max(need.get(key, -1e9), s["t"] - s["consumer"]["t0"])
    shift = {r: 0.0 for r in ranks}
    for _ in range(len(ranks) + 1):
        changed = False
        for (r, p), c in need.items():
            if shift[p] + c > shift[r] + 1e-12:
                shift[r], changed = shift[p] + c, True
        if not changed:
            break
    else:
        print("signal_svg: the ready/pull order admits no clock shift; drawn unshifted",
              file=sys.stderr)
        return {r: 0.0 for r in ranks}
    low = min(shift.values())
    return {r: v - low for r, v in shift.items()}


def panel_svg(out, y0, title, drawn, signals, ranks, width, left=150, right=20):
    lo = min(e["t0"] for e in drawn)
    hi = max(max(e["t1"] for e in drawn), max(s["t"] for s in signals))
    pad = (hi - lo) * 0.02
    lo, hi = lo - pad, hi + pad
    plot_w = width - left - right
    x = lambda t: left + (t - lo) * plot_w / (hi - lo)
    row_h, gap = 22, 14
    rows = [(r, lane) for r in ranks for lane in (COMPUTE, COPY)]
    row_y = {}
    out.append(f'<text x="{left}" y="{y0 + 14}" font-size="13" font-weight="bold">'
               f'{escape(title)}</text>')
    y = y0 + 26
    for r, lane in rows:
        row_y[(r, lane)] = y
        out.append(f'<rect x="{left}" y="{y}" width="{plot_w}" height="{row_h}" fill="#f5f5f5"/>')
        out.append(f'<text x="{left - 8}" y="{y + 15}" text-anchor="end" font-weight="bold">'
                   f'rank {r} {"compute" if lane == COMPUTE else "copy"}</text>')
        y += row_h + (gap if lane == COPY else 2)
    for e in drawn:
        ry = row_y[(e["pid"], e["tid"])]
        x0, x1 = x(e["t0"]), x(e["t1"])
        w = max(x1 - x0, 1.5)
        label = e["name"].split(" ", 1)[1] if " " in e["name"] else e["name"]
        label = label.replace("GEMM step ", "GEMM ")
        out.append(f'<g><title>{escape(e["name"])}: {e["t1"] - e["t0"]:.3f} ms</title>'
                   f'<rect x="{x0:.1f}" y="{ry + 1}" width="{w:.1f}" height="{row_h - 2}" '
                   f'fill="{FILL[kind(e["name"])]}" stroke="#fff" stroke-width="0.5"/>')
        if kind(e["name"]) == "pull":  # a sliver: name the rank it reads from beside it
            src = e.get("peer")
            j = int(e["name"].rsplit(" ", 1)[1].split("/")[0])  # pulls 1, 2, …: alternate lines
            out.append(f'<text x="{x1 + 3:.1f}" y="{ry + (9 if j % 2 else 20)}" font-size="9" '
                       f'fill="#1d6d6d">'
                       f'{escape(src)}</text>' if src else "")
        elif len(label) * 6.2 + 4 <= w:
            dark = kind(e["name"]) in ("publish", "add")
            out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{ry + 15}" text-anchor="middle" '
                       f'fill="{"#222" if dark else "#fff"}">{escape(label)}</text>')
        out.append("</g>")
    for s in signals:
        sy = row_y[(s["src"], s["src_lane"])] + row_h / 2
        if s["kind"] == "ready":
            c = s["consumer"]
            tx, ty = x(c["t0"]), row_y[(c["pid"], c["tid"])] + row_h / 2
            colour, dash = READY, ""
        else:  # into the producer's pad: drawn to the row that waits on it in the next use
            tx = x(s["t"]) + 10
            ty = row_y[(s["dst"], s["wait_lane"])] + row_h / 2
            colour, dash = DONE, ' stroke-dasharray="4 3"'
        sx = x(s["t"])
        out.append(f'<g><title>rank {s["src"]} writes {s["kind"]} = {s["gen"]} into rank '
                   f'{s["dst"]}\'s pad at {s["t"] - lo:.3f} ms (after {escape(s["after"])})</title>'
                   f'<circle cx="{sx:.1f}" cy="{sy:.1f}" r="3" fill="{colour}"/>'
                   f'<line x1="{sx:.1f}" y1="{sy:.1f}" x2="{tx:.1f}" y2="{ty:.1f}" stroke="{colour}" '
                   f'stroke-width="1.3"{dash} marker-end="url(#{s["kind"]})"/></g>')
    axis_y = y + 2
    step = trace_svg.nice_step(hi - lo, 8)
    t = 0.0
    while t <= hi - lo + 1e-9:
        out.append(f'<line x1="{x(lo + t):.1f}" y1="{axis_y}" x2="{x(lo + t):.1f}" '
                   f'y2="{axis_y + 4}" stroke="#333"/>'
                   f'<text x="{x(lo + t):.1f}" y="{axis_y + 16}" text-anchor="middle">'
                   f'{trace_svg.fmt_ms(round(t, 6))}</text>')
        t += step
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + plot_w}" y2="{axis_y}" stroke="#333"/>')
    out.append(f'<text x="{left + plot_w}" y="{axis_y + 30}" text-anchor="end">ms from the panel '
               f'start</text>')
    return axis_y + 40, lo


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a --trace file of 05_copy_engine_async_tp or 06_fp8")
    ap.add_argument("--step", type=int, default=1, help="the step (0-based) whose forward is drawn")
    ap.add_argument("--ag", default="qkv", help="the all-gather's role (default qkv)")
    ap.add_argument("--rs", default="o", help="the reduce-scatter's role (default o)")
    ap.add_argument("--title", help="a title line")
    ap.add_argument("--width", type=int, default=1200)
    ap.add_argument("-o", "--output", help="the SVG to write")
    ap.add_argument("--text", action="store_true", help="print the signals in time order")
    a = ap.parse_args()
    if not a.output and not a.text:
        ap.error("nothing to do: give -o FILE.svg and/or --text")
    spans, _, _, _ = trace_svg.load(a.trace)
    ranks = sorted({e["pid"] for e in spans})
    if len(ranks) < 2:
        tool_errors.fail("the trace has one rank: no signals")
    t0, t1 = trace_svg.step_window(spans, ranks, a.step, "forward")
    parts = [("all-gather of " + a.ag, *gather(spans, ranks, a.ag, t0, t1)),
             ("reduce-scatter of " + a.rs, *reduce_scatter(spans, ranks, a.rs, t0, t1))]
    shift = align(ranks, [s for _, _, signals in parts for s in signals])
    for _, drawn, signals in parts:
        for i, e in enumerate(drawn):
            drawn[i] = dict(e, t0=e["t0"] + shift[e["pid"]], t1=e["t1"] + shift[e["pid"]])
        for s in signals:
            s["t"] += shift[s["src"]]
            if "consumer" in s:
                c = s["consumer"]
                s["consumer"] = dict(c, t0=c["t0"] + shift[c["pid"]], t1=c["t1"] + shift[c["pid"]])
    print("clock shift per rank (us), the least that puts every pull after its ready signal: "
          + ", ".join(f"rank {r} {shift[r] * 1000:+.0f}" for r in ranks), file=sys.stderr)

    if a.output:
        title = a.title or f"{os.path.basename(a.trace)}: signals of step {a.step}"
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{a.width}" height="HEIGHT" '
               f'viewBox="0 0 {a.width} HEIGHT" font-family="Helvetica, Arial, sans-serif" '
               f'font-size="11">', f"<title>{escape(title)}</title>",
               '<defs>' + "".join(
                   f'<marker id="{k}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
                   f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
                   f'fill="{c}"/></marker>' for k, c in (("ready", READY), ("done", DONE)))
               + "</defs>", f'<rect x="0" y="0" width="{a.width}" height="HEIGHT" fill="#fff"/>',
               f'<text x="150" y="22" font-size="13" font-weight="bold">{escape(title)}</text>']
        y = 34
        for name, drawn, signals in parts:
            y, _ = panel_svg(out, y, f"{name}, N = {len(ranks)}", drawn, signals, ranks, a.width)
        legend = [(FILL["GEMM"], "GEMM"), (FILL["publish"], "publish (own chunk into own buffer)"),
                  (FILL["pull"], "pull (copy engine: peer buffer -> local)"),
                  (FILL["add"], "add a landed partial sum")]
        x = 150
        for colour, text in legend:
            out.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{colour}"/>'
                       f'<text x="{x + 16}" y="{y + 10}">{escape(text)}</text>')
            x += 28 + int(len(text) * 6.0)
        y += 22
        out.append(f'<line x1="150" y1="{y}" x2="180" y2="{y}" stroke="{READY}" stroke-width="1.3" '
                   f'marker-end="url(#ready)"/><text x="186" y="{y + 4}">ready = k: the producer '
                   f'wrote the chunk (or slot); drawn to the pull that waited for it</text>')
        y += 18
        out.append(f'<line x1="150" y1="{y}" x2="180" y2="{y}" stroke="{DONE}" stroke-width="1.3" '
                   f'stroke-dasharray="4 3" marker-end="url(#done)"/><text x="186" y="{y + 4}">'
                   f'done = k: the consumer has pulled; the producer may overwrite it in use k + 1'
                   f'</text>')
        y += 18
        svg = "\n".join(out).replace("HEIGHT", str(y + 4)) + "\n</svg>\n"
        with open(a.output, "w", encoding="utf-8") as f:
            f.write(svg)
    if a.text:
        for name, drawn, signals in parts:
            lo = min(e["t0"] for e in drawn)
            print(f"{name}, step {a.step}, N = {len(ranks)} (ms from the first span drawn)")
            for s in sorted(signals, key=lambda s: s["t"]):
                wait = ""
                if s["kind"] == "ready":
                    wait = f"; rank {s['dst']}'s pull starts {s['consumer']['t0'] - lo:7.3f}"
                print(f"  {s['t'] - lo:7.3f}  rank {s['src']} -> rank {s['dst']}: "
                      f"{s['kind']:5} = {s['gen']:<3} after '{s['after']}'{wait}")


if __name__ == "__main__":
    tool_errors.run(main, "signal_svg")
