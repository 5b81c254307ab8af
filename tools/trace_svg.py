#!/usr/bin/env python3
"""Draws a window of a tpx --trace file as an SVG timeline (and, with --ascii, as text).

The input is what every stage writes with --trace FILE: Chrome trace JSON, {"traceEvents": [...]},
complete events (ph "X") with pid = rank, tid = lane (0 compute, 1 comm, 2 copy, 3 phases, 4 dp
comm, 5 cp comm, 6 pp comm, 7 ep comm), ts and dur in microseconds; metadata events (ph "M") name
the ranks and lanes. The output has one row per (rank, lane) for the compute, comm and (when they
have spans) copy, dp comm, cp comm, pp comm and ep comm lanes, and for a pipeline (stage 09) a row
of its actions (the phases lane's F3, B3, W3 or F3@5 spans) above each rank's rows, one rectangle
per span, coloured by kind, with its name written inside when it fits (a shorter form of the name when only
that fits) and always as a tooltip.

The window is either raw trace time (--from-ms / --to-ms from the trace's origin) or a training
step: --step K (0-based, as in the step table) runs from the K-th "forward" span on the phases lane
through the end of the "update" span that follows it, over the ranks drawn (a pipeline has no
"forward" span: its step K runs from its first action after the K-th "update" to the end of the
next one). --phase NAME narrows a
step to one of its phases (forward, loss, backward, update); with --step, --from-ms / --to-ms are
taken from the step's start. --from-span NAME starts the window where the first span of that name
(on any lane of the ranks drawn) starts; --until-span NAME ends it where the first span of that
name ends on the last rank to finish one, e.g. "residual add 2 fwd" for the first layer's forward.

All ranks share one time axis: each rank's trace clock starts right after the ranks' start-up
agreement, so their times are comparable to within that start-up skew.

The SVG's title, written above the rows and as its <title> (the name a browser shows for it, and
what a screen reader reads), is --title, or without one the stage and ranks (from the trace's
"otherData", else the trace file's name) and the step or window drawn.

Each row's label also gives the rank's exposed communication inside the window, by the definition
of common/trace.h: the time during which a counted comm or copy span runs and no compute span does;
the drawing shades those intervals in red across the rank's rows.

A trace that cannot be read, or an output that cannot be written, is one line and exit status 2
(tools/tool_errors.py).

    python3 tools/trace_svg.py out/04.trace.json --step 2 --phase forward -o docs/figures/x.svg
    python3 tools/trace_svg.py out/04.trace.json --from-ms 150 --to-ms 160 --rank 0 --ascii 100

Python 3 standard library only.
"""

import argparse
import json
import math
import os
import re
import sys
from xml.sax.saxutils import escape

import tool_errors

(LANE_COMPUTE, LANE_COMM, LANE_COPY, LANE_PHASES, LANE_DP_COMM, LANE_CP_COMM, LANE_PP_COMM,
 LANE_EP_COMM) = range(8)
DEFAULT_LANE_NAMES = {LANE_COMPUTE: "compute", LANE_COMM: "comm", LANE_COPY: "copy",
                      LANE_PHASES: "phases", LANE_DP_COMM: "dp comm", LANE_CP_COMM: "cp comm",
                      LANE_PP_COMM: "pp comm", LANE_EP_COMM: "ep comm"}
COMM_LANES = (LANE_COMM, LANE_COPY, LANE_DP_COMM, LANE_CP_COMM, LANE_PP_COMM, LANE_EP_COMM)

# kind -> (fill colour, ASCII character, legend text)
KINDS = {
    "gemm": ("#4878cf", "G", "GEMM"),
    "compute": ("#a6a6a6", "c", "other compute"),
    "ag": ("#3a9e5a", "A", "all-gather transfer"),
    "rs": ("#e08a2c", "R", "reduce-scatter transfer"),
    "pull": ("#2f8f8f", "P", "copy-engine pull"),
    "publish": ("#9fd4d4", "p", "publish into symmetric memory"),
    "comm": ("#9b6bbf", "o", "other comm (all-reduce, ...)"),
    "uncounted": ("#e4d7ee", "-", "reporting only (not counted)"),
    "act_f": ("#2b8cbe", "F", "F: forward"),
    "act_b": ("#e6550d", "B", "B: backward"),
    "act_w": ("#fdd0a2", "W", "W: weight grads"),
    "phase": ("#dddddd", "=", "phase"),
}
ACTION = re.compile(r"^([FBW])\d+(@\d+)?$")  # a pipeline's action on the phases lane


def kind_of(event):
    """The colour class of a span, from its lane and name."""
    name = event["name"]
    if event["tid"] == LANE_PHASES:
        m = ACTION.match(name)
        return {"F": "act_f", "B": "act_b", "W": "act_w"}[m.group(1)] if m else "phase"
    if event["tid"] == LANE_COMPUTE:
        return "gemm" if "GEMM" in name else "compute"
    if not counted(event):
        return "uncounted"
    low = name.lower()
    if " ag step" in low or "all-gather" in low or "all_gather" in low or "k/v ring" in low:
        return "ag"
    if " rs step" in low or "reduce-scatter" in low or "reduce_scatter" in low:
        return "rs"
    if " pull " in low:
        return "pull"
    if low.endswith(" publish"):
        return "publish"
    return "comm"


def load(path):
    """(spans, lane names, rank names, the run's "otherData": stage and world size, or {})."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except ValueError as e:
            tool_errors.fail(f"{path} is not a trace (not JSON: {e})")
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        tool_errors.fail(f"{path} is not a trace (no traceEvents)")
    about = data.get("otherData", {}) if isinstance(data, dict) else {}
    spans, lane_names, rank_names = [], dict(DEFAULT_LANE_NAMES), {}
    for e in events:
        if e.get("ph") == "M":
            if e.get("name") == "thread_name":
                lane_names[e["tid"]] = e["args"]["name"]
            elif e.get("name") == "process_name":
                rank_names[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "X":
            e = dict(e)
            e["t0"] = e["ts"] / 1000.0  # ms
            e["t1"] = (e["ts"] + e.get("dur", 0.0)) / 1000.0
            spans.append(e)
    return spans, lane_names, rank_names, about


def counted(event):
    """False for reporting-only traffic (the trace marks it "args": {"counted": false})."""
    return (event.get("args") or {}).get("counted") is not False


def phase_spans(spans, rank, name):
    mine = (e for e in spans if e["pid"] == rank and e["tid"] == LANE_PHASES and e["name"] == name)
    return sorted(mine, key=lambda e: e["t0"])


def step_window(spans, ranks, step, phase):
    """[t0, t1) in ms of step `step` (or of one of its phases) over `ranks`."""
    t0, t1 = math.inf, -math.inf
    for r in ranks:
        forwards = phase_spans(spans, r, "forward")
        if not forwards and not phase:  # a pipeline: its steps are its actions between updates
            updates = phase_spans(spans, r, "update")
            if step >= len(updates):
                tool_errors.fail(f"rank {r} has {len(updates)} update spans; no step {step}")
            after = updates[step - 1]["t1"] if step > 0 else -math.inf
            actions = [e for e in spans if e["pid"] == r and e["tid"] == LANE_PHASES
                       and ACTION.match(e["name"]) and e["t0"] >= after]
            if not actions:
                tool_errors.fail(f"rank {r}, step {step} has no pipeline action")
            t0 = min(t0, min(e["t0"] for e in actions))
            t1 = max(t1, updates[step]["t1"])
            continue
        if step >= len(forwards):
            tool_errors.fail(f"rank {r} has {len(forwards)} forward spans; no step {step}")
        start = forwards[step]["t0"]
        nxt = forwards[step + 1]["t0"] if step + 1 < len(forwards) else math.inf
        if phase:
            hits = [e for e in phase_spans(spans, r, phase) if start <= e["t0"] < nxt]
            if not hits:
                tool_errors.fail(f"rank {r}, step {step} has no '{phase}' span on the phases lane")
            t0, t1 = min(t0, hits[0]["t0"]), max(t1, hits[0]["t1"])
        else:
            updates = [e for e in phase_spans(spans, r, "update") if e["t0"] >= start]
            if not updates:
                tool_errors.fail(f"rank {r}, step {step} has no 'update' span after its forward")
            t0, t1 = min(t0, start), max(t1, updates[0]["t1"])
    return t0, t1


def merged(intervals):
    out = []
    for b, e in sorted(intervals):
        if out and b <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([b, e])
    return out


def exposed_ms(spans, rank, t0, t1):
    """common/trace.h's exposed communication of `rank` within [t0, t1): ∪ comm \\ ∪ compute."""
    return sum(e - b for b, e in exposed_intervals(spans, rank, t0, t1))


def exposed_intervals(spans, rank, t0, t1):
    """The intervals [b, e) within [t0, t1) in which a counted comm or copy span of `rank` runs
    and none of its compute spans does."""
    comm, busy = [], []
    for e in spans:
        if e["pid"] != rank:
            continue
        b, en = max(e["t0"], t0), min(e["t1"], t1)
        if b >= en:
            continue
        if e["tid"] == LANE_COMPUTE:
            busy.append((b, en))
        elif e["tid"] in COMM_LANES and counted(e):
            comm.append((b, en))
    busy = merged(busy)
    out = []
    for b, e in merged(comm):
        for x, y in busy:  # cut every busy interval out of [b, e)
            if y <= b or x >= e:
                continue
            if x > b:
                out.append((b, x))
            b = max(b, y)
        if b < e:
            out.append((b, e))
    return out


def lane_hidden_ms(spans, rank, lane, t0, t1):
    """(busy, hidden): the time within [t0, t1) in which `rank` has a counted span on `lane`, and
    the part of it during which a compute span of the rank runs too (hidden behind compute)."""
    mine = [e for e in spans if e["pid"] == rank and (e["tid"] == LANE_COMPUTE or
                                                      (e["tid"] == lane and counted(e)))]
    busy = sum(e - b for b, e in merged([(max(x["t0"], t0), min(x["t1"], t1)) for x in mine
                                         if x["tid"] == lane and min(x["t1"], t1) > max(x["t0"], t0)]))
    return busy, busy - exposed_ms(mine, rank, t0, t1)


def nice_step(span_ms, target_ticks):
    raw = span_ms / max(1, target_ticks)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for m in (1, 2, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def label_candidates(name):
    """The name, then shorter forms of it, longest first."""
    words = name.replace(" step ", " ").split()
    out = [name, " ".join(words)]
    if len(words) >= 3:
        out.append(f"{words[0]} {words[-1]}")  # "qkv GEMM step 1/2" -> "qkv 1/2": the colour says GEMM
    for k in range(1, len(words)):
        out.append(" ".join(words[k:]))
    seen, uniq = set(), []
    for c in out:
        if c and c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def fmt_ms(v):
    return f"{v:.3f}".rstrip("0").rstrip(".") if v != int(v) else f"{int(v)}"


EXPOSED_FILL = "#d62728"  # the shading of exposed communication


def render_svg(spans, rows, lane_names, rank_names, t0, t1, width, title, exposed):
    font, char_w = 11, 6.4  # px; char_w: a generous average advance for an 11 px sans-serif
    left, right, top, row_h, gap = 170, 20, 46, 26, 6
    plot_w = width - left - right
    n_rows = len(rows)
    axis_y = top + n_rows * (row_h + gap) + 4
    legend_y = axis_y + 56
    height = legend_y + 24
    scale = plot_w / (t1 - t0)

    def x_of(t):
        return left + (t - t0) * scale

    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="{font}">',
        f'<title>{escape(title)}</title>',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{left}" y="20" font-size="13" font-weight="bold">{escape(title)}</text>',
    ]

    # Gridlines and axis.
    step = nice_step(t1 - t0, max(2, plot_w // 90))
    for k in range(int((t1 - t0) / step + 1e-9) + 1):
        tick = k * step
        x = x_of(t0 + tick)
        out.append(f'<line x1="{x:.2f}" y1="{top - 4}" x2="{x:.2f}" y2="{axis_y}" stroke="#e6e6e6"/>')
        out.append(f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 5}" stroke="#333"/>')
        out.append(f'<text x="{x:.2f}" y="{axis_y + 17}" text-anchor="middle">'
                   f'{fmt_ms(round(tick, 6))}</text>')
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + plot_w}" y2="{axis_y}" stroke="#333"/>')
    out.append(f'<text x="{left + plot_w}" y="{axis_y + 32}" text-anchor="end">'
               f'ms from the window start ({fmt_ms(round(t0, 3))} ms into the trace)</text>')

    for i, (rank, lane) in enumerate(rows):
        y = top + i * (row_h + gap)
        if i > 0 and rows[i - 1][0] != rank:  # a rule between ranks
            out.append(f'<line x1="8" y1="{y - gap / 2:.1f}" x2="{width - 8}" y2="{y - gap / 2:.1f}" '
                       f'stroke="#bbbbbb" stroke-dasharray="4 3"/>')
        rname = rank_names.get(rank, f"rank {rank}")
        label = f"{rname} {lane_names.get(lane, str(lane))}"
        out.append(f'<rect x="{left}" y="{y}" width="{plot_w}" height="{row_h}" fill="#f7f7f7"/>')
        out.append(f'<text x="{left - 8}" y="{y + row_h / 2 - 2:.1f}" text-anchor="end" '
                   f'font-weight="bold">{escape(label)}</text>')
        if lane == LANE_COMM:
            out.append(f'<text x="{left - 8}" y="{y + row_h / 2 + 10:.1f}" text-anchor="end" '
                       f'fill="#555" font-size="10">exposed {exposed[rank]:.3f} ms</text>')
        mine = sorted((e for e in spans if e["pid"] == rank and e["tid"] == lane), key=lambda e: e["t0"])
        for e in mine:
            b, en = max(e["t0"], t0), min(e["t1"], t1)
            if b >= en:
                continue
            x0, x1 = x_of(b), x_of(en)
            w = max(x1 - x0, 0.5)
            fill = KINDS[kind_of(e)][0]
            tip = f'{e["name"]}: {e["t1"] - e["t0"]:.3f} ms, at {e["t0"] - t0:.3f} ms'
            out.append(f'<g><title>{escape(tip)}</title>'
                       f'<rect x="{x0:.2f}" y="{y + 1}" width="{w:.2f}" height="{row_h - 2}" '
                       f'fill="{fill}" stroke="#ffffff" stroke-width="0.5"/>')
            for text in label_candidates(e["name"]):
                if len(text) * char_w + 6 <= w:
                    dark = kind_of(e) in ("compute", "uncounted", "act_w", "phase")
                    out.append(f'<text x="{(x0 + x1) / 2:.2f}" y="{y + row_h / 2 + 4:.1f}" '
                               f'text-anchor="middle" fill="{"#222" if dark else "#fff"}">'
                               f'{escape(text)}</text>')
                    break
            out.append("</g>")

    # Exposed communication: a translucent band over each of the rank's rows, and a solid bar
    # under its comm row, for every interval in which it communicates and computes nothing.
    any_exposed = False
    for rank in sorted({r for r, _ in rows}):
        ys = [top + i * (row_h + gap) for i, (r, _) in enumerate(rows) if r == rank]
        comm_y = next(top + i * (row_h + gap) for i, (r, lane) in enumerate(rows)
                      if r == rank and lane == LANE_COMM)
        for b, e in exposed_intervals(spans, rank, t0, t1):
            any_exposed = True
            x0, w = x_of(b), max((e - b) * scale, 0.5)
            out.append(f'<g><title>{escape(f"rank {rank}: exposed comm {e - b:.3f} ms, at {b - t0:.3f} ms")}</title>'
                       f'<rect x="{x0:.2f}" y="{ys[0]}" width="{w:.2f}" '
                       f'height="{ys[-1] + row_h - ys[0]}" fill="{EXPOSED_FILL}" fill-opacity="0.16"/>'
                       f'<rect x="{x0:.2f}" y="{comm_y + row_h - 4}" width="{w:.2f}" height="4" '
                       f'fill="{EXPOSED_FILL}"/></g>')

    # Legend: the kinds drawn, and the shading when there is any.
    drawn = {kind_of(e) for e in in_window(spans, rows, t0, t1)}
    keys = [(KINDS[k][0], KINDS[k][2], 1.0) for k in KINDS if k in drawn]
    if any_exposed:
        keys.append((EXPOSED_FILL, "exposed comm (no compute beside it)", 0.6))
    x = left
    for colour, text, opacity in keys:
        out.append(f'<rect x="{x}" y="{legend_y - 10}" width="12" height="12" fill="{colour}" '
                   f'fill-opacity="{opacity}"/>')
        out.append(f'<text x="{x + 16}" y="{legend_y}">{escape(text)}</text>')
        x += 16 + len(text) * 6 + 16
    out.append("</svg>")
    return "\n".join(out) + "\n"


def in_window(spans, rows, t0, t1):
    shown = set(rows)
    return [e for e in spans if (e["pid"], e["tid"]) in shown and e["t1"] > t0 and e["t0"] < t1]


def ascii_char(event, marks):
    for sub, ch in marks:
        if sub in event["name"]:
            return ch
    return KINDS[kind_of(event)][1]


def render_ascii(spans, rows, lane_names, rank_names, t0, t1, cols, exposed, marks):
    """One line per row: each column is the kind of span covering most of its time ('.' idle)."""
    dt = (t1 - t0) / cols
    lines = []
    for rank, lane in rows:
        cover = [dict() for _ in range(cols)]
        for e in spans:
            if e["pid"] != rank or e["tid"] != lane:
                continue
            b, en = max(e["t0"], t0), min(e["t1"], t1)
            if b >= en:
                continue
            ch = ascii_char(e, marks)
            for c in range(int((b - t0) / dt), min(cols, int(math.ceil((en - t0) / dt)))):
                lo, hi = t0 + c * dt, t0 + (c + 1) * dt
                part = min(hi, en) - max(lo, b)
                if part > 0:
                    cover[c][ch] = cover[c].get(ch, 0.0) + part
        cells = "".join(max(d, key=d.get) if d and max(d.values()) >= dt / 2 else "." for d in cover)
        name = f"{rank_names.get(rank, f'rank {rank}')} {lane_names.get(lane, str(lane))}"
        lines.append(f"{name:>15} |{cells}|")
    ruler = [" "] * (cols + 1)
    step = nice_step(t1 - t0, max(2, cols // 12))
    ticks = []
    for k in range(int((t1 - t0) / step + 1e-9) + 1):
        c = int(round(k * step / dt))
        if c <= cols:
            ruler[c] = "|"
            ticks.append((c, fmt_ms(round(k * step, 6))))
    lines.append(" " * 16 + "".join(ruler))
    text = [" "] * (cols + 12)
    for c, m in ticks:
        if all(ch == " " for ch in text[c:c + len(m) + 1]):
            text[c:c + len(m)] = m
    lines.append(" " * 16 + "".join(text).rstrip() + "  ms")
    shown = in_window(spans, rows, t0, t1)
    present = {kind_of(e) for e in shown if ascii_char(e, marks) == KINDS[kind_of(e)][1]}
    keys = [f"{KINDS[k][1]} {KINDS[k][2]}" for k in KINDS if k in present]
    keys += [f"{ch} {sub}" for sub, ch in marks if any(sub in e["name"] for e in shown)]
    keys.append(". idle")
    line = ""
    for k in keys:  # wrap the key to the width of the rows
        if line and len(line) + 2 + len(k) > cols:
            lines.append(f"{'':16}{line}")
            line = ""
        line = f"{line}  {k}" if line else k
    lines.append(f"{'':16}{line}")
    for rank in sorted({r for r, _ in rows}):
        lines.append(f"{'':16}rank {rank}: exposed comm {exposed[rank]:.3f} ms of {t1 - t0:.3f} ms")
    return "\n".join(lines) + "\n"


def default_title(a, about, ranks, all_ranks, t0, t1):
    """"04_overlap_ring, 2 ranks (drawn: 0, 1): forward of step 2": the stage and its ranks (from
    the trace's otherData, else the file's name), the ranks drawn, and the step or window."""
    stage = about.get("stage") or os.path.basename(a.trace)
    world = about.get("world_size") or len(all_ranks)
    drawn = "" if ranks == all_ranks else f" (drawn: {', '.join(map(str, ranks))})"
    what = (f"{a.phase or 'forward to update'} of step {a.step}" if a.step is not None
            else f"{t0:.3f} .. {t1:.3f} ms")
    return f"{stage}, {world} rank{'s' if world != 1 else ''}{drawn}: {what}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a --trace file (Chrome trace JSON)")
    ap.add_argument("-o", "--output", help="the SVG to write (none: no SVG)")
    ap.add_argument("--rank", type=int, action="append",
                    help="a rank to draw (repeatable; default: all)")
    ap.add_argument("--step", type=int,
                    help="the step to draw (0-based): its forward through its update")
    ap.add_argument("--phase", help="with --step: only this phase (forward, loss, backward, update)")
    ap.add_argument("--from-ms", type=float,
                    help="window start, ms (from the step's start with --step)")
    ap.add_argument("--to-ms", type=float,
                    help="window end, ms (from the step's start with --step)")
    ap.add_argument("--from-span",
                    help="start the window where the first span of this name starts")
    ap.add_argument("--until-span",
                    help="end the window where the first span of this name ends")
    ap.add_argument("--width", type=int, default=1400, help="SVG width in px (default 1400)")
    ap.add_argument("--title", help="the SVG's title (default: the stage, ranks and window)")
    ap.add_argument("--ascii", type=int, metavar="COLS",
                    help="also print the window as text, COLS wide")
    ap.add_argument("--char", action="append", default=[], metavar="SUBSTR=C",
                    help="--ascii: draw spans whose name contains SUBSTR with character C (repeatable)")
    a = ap.parse_args()
    if not a.output and not a.ascii:
        ap.error("nothing to do: give -o FILE.svg and/or --ascii COLS")
    marks = []
    for m in a.char:
        sub, sep, ch = m.rpartition("=")
        if not sep or not sub or len(ch) != 1:
            ap.error(f"--char wants SUBSTR=C, got '{m}'")
        marks.append((sub, ch))

    spans, lane_names, rank_names, about = load(a.trace)
    all_ranks = sorted({e["pid"] for e in spans})
    ranks = sorted(set(a.rank)) if a.rank else all_ranks
    for r in ranks:
        if r not in all_ranks:
            tool_errors.fail(f"no rank {r} in {a.trace} (ranks: {all_ranks})")
    if a.phase and a.step is None:
        tool_errors.fail("--phase needs --step")

    if a.step is not None:
        t0, t1 = step_window(spans, ranks, a.step, a.phase)
        base = t0
        if a.from_ms is not None:
            t0 = base + a.from_ms
        if a.to_ms is not None:
            t1 = min(t1, base + a.to_ms)
    else:
        mine = [e for e in spans if e["pid"] in ranks]
        t0 = a.from_ms if a.from_ms is not None else min(e["t0"] for e in mine)
        t1 = a.to_ms if a.to_ms is not None else max(e["t1"] for e in mine)
    if a.from_span:
        starts = [e["t0"] for e in spans
                  if e["pid"] in ranks and e["name"] == a.from_span and e["t0"] >= t0]
        if not starts:
            tool_errors.fail(f"no span '{a.from_span}' after {t0:.3f} ms")
        t0 = min(starts)
    if a.until_span:
        first_end = {}  # rank -> end of its first such span in the window
        for e in spans:
            if e["pid"] in ranks and e["name"] == a.until_span and e["t0"] >= t0:
                first_end[e["pid"]] = min(first_end.get(e["pid"], math.inf), e["t1"])
        if not first_end:
            tool_errors.fail(f"no span '{a.until_span}' after {t0:.3f} ms")
        t1 = max(first_end.values())
    if not t1 > t0:
        tool_errors.fail(f"empty window [{t0:.3f}, {t1:.3f}) ms")

    rows = []
    for r in ranks:
        if any(e["pid"] == r and e["tid"] == LANE_PHASES and ACTION.match(e["name"])
               for e in spans):
            rows.append((r, LANE_PHASES))  # a pipeline's actions, above the rank's lanes
        for lane in (LANE_COMPUTE,) + COMM_LANES:
            has = any(e["pid"] == r and e["tid"] == lane for e in spans)
            if lane in (LANE_COMPUTE, LANE_COMM) or has:
                rows.append((r, lane))
    exposed = {r: exposed_ms(spans, r, t0, t1) for r in ranks}

    if a.output:
        title = a.title or default_title(a, about, ranks, all_ranks, t0, t1)
        svg = render_svg(spans, rows, lane_names, rank_names, t0, t1, a.width, title, exposed)
        with open(a.output, "w", encoding="utf-8") as f:
            f.write(svg)
    if a.ascii:
        sys.stdout.write(render_ascii(spans, rows, lane_names, rank_names, t0, t1, a.ascii,
                                      exposed, marks))
    print(f"window {t0:.3f} .. {t1:.3f} ms into the trace ({t1 - t0:.3f} ms)", file=sys.stderr)
    for r in ranks:
        sums = {}
        for e in spans:
            if e["pid"] == r and e["tid"] in (LANE_COMPUTE, LANE_COMM, LANE_COPY):
                part = min(e["t1"], t1) - max(e["t0"], t0)
                if part > 0:
                    sums[kind_of(e)] = sums.get(kind_of(e), 0.0) + part
        text = ", ".join(f"{KINDS[k][2]} {sums[k]:.3f}" for k in KINDS if k in sums) or "none"
        print(f"  rank {r}: span time by kind (ms): {text}; exposed comm {exposed[r]:.3f}",
              file=sys.stderr)
        for lane in COMM_LANES:
            busy, hidden = lane_hidden_ms(spans, r, lane, t0, t1)
            if busy > 0:
                print(f"    {lane_names.get(lane, lane)}: {busy:.3f} ms, {hidden:.3f} of it hidden "
                      f"behind compute", file=sys.stderr)


if __name__ == "__main__":
    tool_errors.run(main, "trace_svg")
