#!/usr/bin/env python3
"""Draws how each stage splits the block's weights and activations across ranks, as SVG.

One row per tensor in the order the forward pass makes them, one column per rank. Each cell is
the whole tensor drawn to its shape's proportions (activations as [S·B rows, columns], weights
as [in, out]); the part the rank holds is filled in the rank's colour, the rest is left empty.
A hatched fill marks a partial sum (every rank holds the whole shape, each a different term).

Usage: tools/sharding_svg.py STAGE [--ranks N] -o OUT.svg
       tools/sharding_svg.py --all [--check]      # every chapter's figure into docs/figures/

STAGE is 01, 02 or 03. --all writes 01_sharding.svg, 02_sharding_np2.svg,
03_sharding_np2.svg, 02_gqa_np2.svg (grouped-query attention: NH = 8, NKV = 4, N = 2) and
02_gqa_replicated_np4.svg (NH = 8, NKV = 2, N = 4: the KV-head replication tpx refuses); with
--check it writes nothing and exits 1 if a committed figure differs from what it would write.
Only the standard library.
"""
import argparse
import pathlib
import sys
from xml.sax.saxutils import escape

import tool_errors

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures"
COLORS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2"]

# The drawing's proportions: H and F as the default config has them (F = 4·H), S·B as tall as H.
DIM = {"S": 1.0, "H": 1.0, "F": 2.0}

FULL, ROWS, COLS, PARTIAL = "full", "rows", "cols", "partial"


def tensors(stage):
    """(name, rows, cols, split, what) in forward order for a stage: '01', '02' or '03'.

    rows/cols name the dims (S stands for the S·B token rows); split says which part rank r holds.
    """
    seq = ROWS if stage == "03" else FULL  # the residual stream: split along S in stage 03
    w_col = COLS if stage != "01" else FULL
    w_row = ROWS if stage != "01" else FULL
    partial = PARTIAL if stage != "01" else FULL
    f_note = {"01": "= h", "02": "f: identity", "03": "f: all-gather"}[stage]
    g_note = {"01": "", "02": "g: all-reduce", "03": "g: reduce-scatter"}[stage]
    return [
        ("x", "S", "H", seq, "block input"),
        ("h = RMSNorm(x)", "S", "H", seq, ""),
        ("f(h)", "S", "H", FULL, f_note),
        ("Wq, Wk, Wv", "H", "H", w_col, "[in, out]"),
        ("q, k, v, a", "S", "H", w_col, "whole heads"),
        ("Wo", "H", "H", w_row, "[in, out]"),
        ("a·Wo", "S", "H", partial, "partial sum" if stage != "01" else ""),
        ("x2 = x + g(a·Wo)", "S", "H", seq, g_note),
        ("Wg, Wu", "H", "F", w_col, "[in, out]"),
        ("gate, up, s", "S", "F", w_col, "F columns"),
        ("Wd", "F", "H", w_row, "[in, out]"),
        ("out = x2 + g(s·Wd)", "S", "H", seq, g_note),
    ]


def shape_text(rows, cols, split, n):
    """The tensor's shape on one rank, e.g. '[S/2, B, H]' or '[H, H/2]'."""
    def dim(d, cut):
        return f"{d}/{n}" if cut and n > 1 else d

    r = dim(rows, split == ROWS)
    c = dim(cols, split == COLS)
    return f"[{r}, B, {c}]" if rows == "S" else f"[{r}, {c}]"


def figure(stage, n):
    cell_w, unit = 150, 36  # a cell's width, and pixels per unit of DIM
    left, top, gap = 170, 52, 10
    rows = tensors(stage)
    heights = [max(DIM[rd] * unit + 14, 46) for _, rd, _, _, _ in rows]
    width = max(left + n * (cell_w + gap) + 10, 560)
    height = top + sum(heights) + 48
    title = {"01": "stage 01: one device holds everything",
             "02": f"stage 02: weights split over {n} ranks, residual stream replicated",
             "03": f"stage 03: weights split, residual stream split along S over {n} ranks"}[stage]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           '<defs><pattern id="partial" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" fill="white"/>'
           '<line x1="0" y1="0" x2="0" y2="6" stroke="#888" stroke-width="3"/></pattern></defs>',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>']
    for r in range(n):
        x = left + r * (cell_w + gap)
        out.append(f'<text x="{x + cell_w / 2}" y="{top - 12}" text-anchor="middle" '
                   f'font-weight="bold" fill="{COLORS[r]}">rank {r}</text>')
    y0 = top
    for i, (name, rd, cd, split, what) in enumerate(rows):
        if i:
            y0 += heights[i - 1]
        out.append(f'<text x="10" y="{y0 + 22}" font-weight="bold">{escape(name)}</text>')
        if what:
            out.append(f'<text x="10" y="{y0 + 37}" fill="#555">{escape(what)}</text>')
        w, h = DIM[cd] * unit, DIM[rd] * unit
        for r in range(n):
            x = left + r * (cell_w + gap)
            bx, by = x + 4, y0 + 4
            out.append(f'<rect x="{bx}" y="{by}" width="{w}" height="{h}" fill="none" '
                       'stroke="#999"/>')
            if split == ROWS:
                part = (bx, by + h * r / n, w, h / n)
            elif split == COLS:
                part = (bx + w * r / n, by, w / n, h)
            else:
                part = (bx, by, w, h)
            fill = "url(#partial)" if split == PARTIAL else COLORS[r]
            opacity = "" if split == PARTIAL else ' fill-opacity="0.8"'
            out.append(f'<rect x="{part[0]:.1f}" y="{part[1]:.1f}" width="{part[2]:.1f}" '
                       f'height="{part[3]:.1f}" fill="{fill}"{opacity} stroke="{COLORS[r]}"/>')
            out.append(f'<text x="{bx + w + 6}" y="{by + 14}">'
                       f'{escape(shape_text(rd, cd, split, n))}</text>')
    out.append(f'<text x="10" y="{height - 28}" fill="#555">filled: the part a rank holds; '
               'hatched: a partial sum of the whole shape</text>')
    out.append(f'<text x="10" y="{height - 12}" fill="#555">activations drawn as [S·B, columns] '
               '(sequence first), weights as [in, out]</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def gqa_figure(nh, nkv, n):
    """Grouped-query attention under tensor parallelism: which query heads, KV heads and weight
    columns each of n ranks holds (NH = nh query heads, NKV = nkv KV heads, nkv % n == 0)."""
    group, head_w, gap, left, top = nh // nkv, 44, 6, 150, 64
    width = max(left + nh * (head_w + gap) + 20, 760)
    height = 330
    title = f"grouped-query attention over {n} ranks: NH = {nh}, NKV = {nkv} (groups of {group})"
    subtitle = (f"each rank holds whole KV heads with their query groups: {nh // n} query heads "
                f"and {nkv // n} KV heads per rank")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
           f'<text x="10" y="38" fill="#555">{escape(subtitle)}</text>']

    def qx(h):  # left edge of query head h's cell
        return left + h * (head_w + gap)

    def kvx(m):  # KV head m sits under the middle of its group
        return (qx(m * group) + qx((m + 1) * group - 1) + head_w) / 2 - head_w / 2

    rows = [("q heads (Wq columns)", top), ("k, v heads (Wk, Wv columns)", top + 120)]
    for label, y in rows:
        out.append(f'<text x="10" y="{y + 22}" font-weight="bold">{escape(label)}</text>')
    for h in range(nh):  # query heads and the line to the KV head each one reads
        r = h // (nh // n)
        m = h // group
        out.append(f'<line x1="{qx(h) + head_w / 2:.1f}" y1="{top + 36}" '
                   f'x2="{kvx(m) + head_w / 2:.1f}" y2="{top + 120}" stroke="{COLORS[r]}" '
                   'stroke-width="1.5"/>')
        out.append(f'<rect x="{qx(h):.1f}" y="{top}" width="{head_w}" height="36" '
                   f'fill="{COLORS[r]}" fill-opacity="0.8" stroke="{COLORS[r]}"/>')
        out.append(f'<text x="{qx(h) + head_w / 2:.1f}" y="{top + 22}" text-anchor="middle" '
                   f'fill="white">q{h}</text>')
    for m in range(nkv):
        r = m // (nkv // n)
        out.append(f'<rect x="{kvx(m):.1f}" y="{top + 120}" width="{head_w}" height="36" '
                   f'fill="{COLORS[r]}" fill-opacity="0.8" stroke="{COLORS[r]}"/>')
        out.append(f'<text x="{kvx(m) + head_w / 2:.1f}" y="{top + 142}" text-anchor="middle" '
                   f'fill="white">kv{m}</text>')
    y = top + 190
    for r in range(n):
        q0, q1 = r * nh // n, (r + 1) * nh // n - 1
        k0, k1 = r * nkv // n, (r + 1) * nkv // n - 1
        kv_text = f"KV head {k0}" if k0 == k1 else f"KV heads {k0}-{k1}"
        holds = (f"rank {r}: q heads {q0}-{q1}, {kv_text}; Wq [H, NH·D/{n}], "
                 f"Wk and Wv [H, NKV·D/{n}], Wo rows [NH·D/{n}, H]")
        out.append(f'<text x="10" y="{y + r * 18}" fill="{COLORS[r]}" font-weight="bold">'
                   f'{escape(holds)}</text>')
    notes = ["a line joins each query head to the KV head it reads: no line crosses from one "
             "rank to another, so attention needs no communication",
             "NKV % N == 0 is what keeps every group on one rank (--kv-heads; else exit 2)"]
    for i, note in enumerate(notes):
        out.append(f'<text x="10" y="{height - 28 + 16 * i}" fill="#555">{escape(note)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def gqa_replicated_figure(nh, nkv, n):
    """What tpx refuses and inference engines do when n > nkv: every rank holds NH/n query heads
    and one copy of their KV head, so each KV head has n/nkv copies, whose weight gradients
    training would have to sum over the ranks sharing them."""
    copies, per_rank = n // nkv, nh // n
    head_w, gap, left, top = 44, 6, 150, 64
    width = max(left + nh * (head_w + gap) + 20, 760)
    height = 380
    title = (f"when N > NKV: KV heads replicated, NH = {nh}, NKV = {nkv}, N = {n} "
             "(not implemented in tpx)")
    subtitle = (f"each rank holds {per_rank} query heads and a copy of the one KV head they read: "
                f"{copies} copies of every KV head")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
           f'<text x="10" y="38" fill="#555">{escape(subtitle)}</text>']

    def qx(h):  # left edge of query head h's cell
        return left + h * (head_w + gap)

    def copyx(r):  # rank r's KV copy sits under the middle of its query heads
        return (qx(r * per_rank) + qx((r + 1) * per_rank - 1)) / 2

    kv_y = top + 110
    for label, y in [("q heads (Wq columns)", top), ("k, v copies (Wk, Wv)", kv_y)]:
        out.append(f'<text x="10" y="{y + 22}" font-weight="bold">{escape(label)}</text>')
    for h in range(nh):
        r = h // per_rank
        out.append(f'<line x1="{qx(h) + head_w / 2:.1f}" y1="{top + 36}" '
                   f'x2="{copyx(r) + head_w / 2:.1f}" y2="{kv_y}" stroke="{COLORS[r]}" '
                   'stroke-width="1.5"/>')
        out.append(f'<rect x="{qx(h):.1f}" y="{top}" width="{head_w}" height="36" '
                   f'fill="{COLORS[r]}" fill-opacity="0.8" stroke="{COLORS[r]}"/>')
        out.append(f'<text x="{qx(h) + head_w / 2:.1f}" y="{top + 22}" text-anchor="middle" '
                   f'fill="white">q{h}</text>')
    for r in range(n):
        m = r // copies
        out.append(f'<rect x="{copyx(r):.1f}" y="{kv_y}" width="{head_w}" height="36" '
                   f'fill="{COLORS[r]}" fill-opacity="0.8" stroke="{COLORS[r]}"/>')
        out.append(f'<text x="{copyx(r) + head_w / 2:.1f}" y="{kv_y + 22}" text-anchor="middle" '
                   f'fill="white">kv{m}</text>')
    bracket_y = kv_y + 50
    for m in range(nkv):  # a bracket under the copies of one KV head: the sum training needs
        r0, r1 = m * copies, (m + 1) * copies - 1
        x0, x1 = copyx(r0) + head_w / 2, copyx(r1) + head_w / 2
        out.append(f'<path d="M {x0:.1f} {bracket_y} v 8 H {x1:.1f} v -8" fill="none" '
                   'stroke="#555" stroke-width="1.5"/>')
        ranks = ", ".join(str(r) for r in range(r0, r1 + 1))
        out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{bracket_y + 22}" text-anchor="middle" '
                   f'fill="#555">dWk, dWv of kv{m}: sum over ranks {ranks}</text>')
    y = bracket_y + 52
    for r in range(n):
        q0, q1 = r * per_rank, (r + 1) * per_rank - 1
        holds = (f"rank {r}: q heads {q0}-{q1}, a copy of KV head {r // copies}; "
                 f"Wq [H, NH·D/{n}], Wk and Wv [H, D] (the copy), Wo rows [NH·D/{n}, H]")
        out.append(f'<text x="10" y="{y + r * 18}" fill="{COLORS[r]}" font-weight="bold">'
                   f'{escape(holds)}</text>')
    notes = ["each copy's gradient holds only its own rank's query heads: without the sum the "
             "copies drift apart after one update",
             "tpx refuses NKV % N != 0 instead (--kv-heads; exit 2), so every rank holds whole "
             "KV heads and their groups"]
    for i, note in enumerate(notes):
        out.append(f'<text x="10" y="{height - 28 + 16 * i}" fill="#555">{escape(note)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", nargs="?", choices=["01", "02", "03"])
    ap.add_argument("--ranks", type=int, help="default: 1 for stage 01, 2 otherwise")
    ap.add_argument("-o", "--out")
    ap.add_argument("--all", action="store_true", help="every chapter's figure into docs/figures")
    ap.add_argument("--check", action="store_true", help="with --all: compare, do not write")
    a = ap.parse_args()
    if a.all:
        stale = []
        for name, svg in [("01_sharding.svg", figure("01", 1)),
                          ("02_sharding_np2.svg", figure("02", 2)),
                          ("03_sharding_np2.svg", figure("03", 2)),
                          ("02_gqa_np2.svg", gqa_figure(8, 4, 2)),
                          ("02_gqa_replicated_np4.svg", gqa_replicated_figure(8, 2, 4))]:
            path = FIGURES / name
            if a.check:
                if not path.exists() or path.read_text() != svg:
                    stale.append(str(path.relative_to(ROOT)))
            else:
                path.write_text(svg)
        for s in stale:
            print(f"{s}: stale; regenerate with tools/sharding_svg.py --all", file=sys.stderr)
        return 1 if stale else 0
    if not a.stage or not a.out:
        ap.error("give STAGE and -o OUT.svg, or --all")
    n = a.ranks or (1 if a.stage == "01" else 2)
    if not 1 <= n <= len(COLORS) or (a.stage == "01" and n != 1):
        ap.error(f"--ranks must be 1 … {len(COLORS)} (and 1 for stage 01)")
    pathlib.Path(a.out).write_text(figure(a.stage, n))
    return 0


if __name__ == "__main__":
    tool_errors.run(main, "sharding_svg")
