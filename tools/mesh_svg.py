#!/usr/bin/env python3
"""Draws the P × D × C × T mesh of a stage 09 run (its --json) as an SVG: one box per pipeline
stage, in it one row per DP replica and one cell per CP rank holding its T TP ranks, and rank 0's
groups outlined (its TP group, CP ring, DP×CP group and PP neighbour) with the bus bytes each
group moved per rank in the run's last step (TP is the step's bytes less the other three).

Usage: tools/mesh_svg.py RUN.json --title TITLE -o OUT.svg

Only the standard library; the numbers are the summary's own.
"""
import argparse
import json
from xml.sax.saxutils import escape

import tool_errors

CELL, GAP, PAD = 34, 6, 14
GROUPS = {"tp": "#d62728", "cp": "#2ca02c", "dpcp": "#1f77b4", "pp": "#ff7f0e"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--title", default="mesh")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    j = json.load(open(a.run))
    if "pipeline" not in j:
        tool_errors.fail(f"no \"pipeline\" object (not a 09_pipeline_parallel --json), {a.run}")
    P, D, C = j["pipeline"]["pp"], j["dp"], j["cp"]
    T = j["world_size"] // (P * D * C)
    s = j["steps"][-1]
    bytes_ = {"cp": s["cp_bus_bytes"], "dpcp": s["dp_bus_bytes"], "pp": s["pp_bus_bytes"]}
    bytes_["tp"] = s["comm_bus_bytes"] - sum(bytes_.values())

    cp_w = T * CELL + (T - 1) * 2 + GAP  # one CP cell: T ranks side by side
    box_w = PAD * 2 + 50 + C * cp_w
    box_h = PAD * 2 + 18 + D * (CELL + GAP)
    arrow = 70
    width = max(60 + P * box_w + (P - 1) * arrow, 720)
    top = 50
    height = top + box_h + 40 + 18 * 5 + 20

    def rank_xy(pp, dp, cp, tp):
        x = 30 + pp * (box_w + arrow) + PAD + 50 + cp * cp_w + tp * (CELL + 2)
        y = top + PAD + 18 + dp * (CELL + GAP)
        return x, y

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f"<title>{escape(a.title)}</title>",
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="30" y="26" font-size="14" font-weight="bold">{escape(a.title)}</text>']
    for pp in range(P):
        x0 = 30 + pp * (box_w + arrow)
        out.append(f'<rect x="{x0}" y="{top}" width="{box_w}" height="{box_h}" rx="6" '
                   f'fill="#f7f7f7" stroke="#999"/>')
        out.append(f'<text x="{x0 + PAD}" y="{top + PAD + 6}" font-weight="bold">pp {pp}</text>')
        for dp in range(D):
            _, y = rank_xy(pp, dp, 0, 0)
            out.append(f'<text x="{x0 + PAD}" y="{y + CELL / 2 + 4}">dp {dp}</text>')
            for cp in range(C):
                for tp in range(T):
                    x, y = rank_xy(pp, dp, cp, tp)
                    rank = ((pp * D + dp) * C + cp) * T + tp
                    out.append(f'<rect x="{x}" y="{y}" width="{CELL}" height="{CELL}" fill="white" '
                               f'stroke="#555"/>')
                    out.append(f'<text x="{x + CELL / 2}" y="{y + CELL / 2 + 4}" '
                               f'text-anchor="middle">{rank}</text>')
        if pp + 1 < P:
            ay = top + box_h / 2
            out.append(f'<line x1="{x0 + box_w + 6}" x2="{x0 + box_w + arrow - 6}" y1="{ay}" '
                       f'y2="{ay}" stroke="{GROUPS["pp"]}" stroke-width="2"/>')
            out.append(f'<text x="{x0 + box_w + arrow / 2}" y="{ay - 6}" text-anchor="middle" '
                       f'fill="{GROUPS["pp"]}">act →</text>')
            out.append(f'<text x="{x0 + box_w + arrow / 2}" y="{ay + 16}" text-anchor="middle" '
                       f'fill="{GROUPS["pp"]}">← grad</text>')

    def mark(cells, group, corner):
        # A dot in one corner of each member's cell: a group need not be a rectangle of cells.
        dx, dy = (7, 7) if corner in (0, 2) else (CELL - 7, 7)
        if corner >= 2:
            dy = CELL - 7
        for c in cells:
            x, y = rank_xy(*c)
            out.append(f'<circle cx="{x + (dx if corner in (0, 2) else dx)}" cy="{y + dy}" r="4" '
                       f'fill="{GROUPS[group]}"/>')

    # Rank 0's groups: the members of each get a dot of the group's colour.
    mark([(0, 0, 0, t) for t in range(T)], "tp", 0)
    mark([(0, 0, c, 0) for c in range(C)], "cp", 1)
    mark([(0, d, c, 0) for d in range(D) for c in range(C)], "dpcp", 2)
    mark([(p, 0, 0, 0) for p in range(P)], "pp", 3)
    for pp in range(P):
        for cp in range(C):
            x, _ = rank_xy(pp, 0, cp, 0)
            out.append(f'<text x="{x + (T * CELL + (T - 1) * 2) / 2}" y="{top + PAD + 6}" '
                       f'text-anchor="middle" fill="#555">cp {cp}</text>')
    y = top + box_h + 30
    out.append(f'<text x="30" y="{y}">rank 0\'s groups (a dot marks each member; tp inside a '
               f"cp cell) and their bus bytes per rank in the last step (--json):</text>")
    rows = [("tp", f"TP group ({T} ranks, consecutive): the block's collectives"),
            ("cp", f"CP ring ({C} ranks): K/V blocks"),
            ("dpcp", f"DP×CP group ({D * C} ranks): FSDP gathers and reduce-scatters"),
            ("pp", f"PP neighbour (rank {D * C * T}): activations and their gradients")]
    for k, (g, words) in enumerate(rows):
        yy = y + 18 * (k + 1)
        out.append(f'<circle cx="36" cy="{yy - 4}" r="5" fill="{GROUPS[g]}"/>')
        out.append(f'<text x="50" y="{yy}">{escape(words)}: {bytes_[g]:,} B</text>')
    out.append("</svg>")
    open(a.output, "w").write("\n".join(out) + "\n")


if __name__ == "__main__":
    tool_errors.run(main, "mesh_svg")
