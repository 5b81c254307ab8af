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
02_gqa_replicated_np4.svg (NH = 8, NKV = 2, N = 4: the KV-head replication tpx refuses),
07_fsdp_tp_cut_np4.svg (a column- and a row-parallel weight cut by TP and then by FSDP on a
D 2 × TP 2 mesh), 08_ring_cp4.svg (which K/V block each of C = 4 CP ranks holds at each ring step,
and the dK/dV hop home) and 08_ulysses_cp2.svg (Ulysses' all-to-all from sequence to head shards
at C = 2), and tools/vocab_svg.py's 02_vocab_parallel_ce_np4.svg (the logits cut over the
vocabulary, T = 4, and the cross-entropy's three all-reduces); with
--check it writes nothing and exits 1 if a committed figure differs from what it would write.
Only the standard library.
"""
import argparse
import pathlib
import sys
from xml.sax.saxutils import escape

import tool_errors
import vocab_svg

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
        holds = (f"rank {r}: q heads {q0}-{q1}, {kv_text}; Wq [H, NH·Dh/{n}], "
                 f"Wk and Wv [H, NKV·Dh/{n}], Wo rows [NH·Dh/{n}, H]")
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
                 f"Wq [H, NH·Dh/{n}], Wk and Wv [H, Dh] (the copy), Wo rows [NH·Dh/{n}, H]")
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


def svg_head(width, height, title, subtitle):
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif" font-size="11">',
            '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="7" refY="4" '
            'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#555"/></marker></defs>',
            f'<rect width="{width}" height="{height}" fill="white"/>',
            f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
            f'<text x="10" y="38" fill="#555">{escape(subtitle)}</text>']


def fsdp_tp_figure(d, t):
    """Stage 07: one column-parallel weight (Wq) and one row-parallel weight (Wo) on a D × T mesh.
    TP cuts Wq's columns and Wo's rows; FSDP then cuts every TP shard's rows (dim 0) over D."""
    n = d * t
    cell, left, top = 240, 40, 80
    width, height = 780, top + cell + 110
    title = f"stage 07: a weight cut both ways on a D {d} × TP {t} mesh (rank = dp·T + tp)"
    subtitle = ("TP cuts the columns of Wq (rows of Wo); FSDP then cuts each TP shard's rows "
                "(dim 0) over the D ranks of its DP group")
    out = svg_head(width, height, title, subtitle)
    for k, (name, shape, tp_cols) in enumerate([("Wq [H, NH·Dh]: column-parallel", "[in, out]", True),
                                                ("Wo [NH·Dh, H]: row-parallel", "[in, out]", False)]):
        x0 = left + k * (cell + 120)
        out.append(f'<text x="{x0}" y="{top - 14}" font-weight="bold">{escape(name)}</text>')
        for tp in range(t):
            for dp in range(d):
                r = dp * t + tp
                if tp_cols:  # TP: a band of columns; FSDP: rows of that band
                    x, w = x0 + cell * tp / t, cell / t
                    y, h = top + cell * dp / d, cell / d
                else:  # TP: a band of rows; FSDP: rows of that band
                    x, w = x0, cell
                    y, h = top + cell * (tp * d + dp) / n, cell / n
                out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" '
                           f'fill="{COLORS[r]}" fill-opacity="0.8" stroke="white" '
                           'stroke-width="2"/>')
                out.append(f'<text x="{x + w / 2:.1f}" y="{y + h / 2 - 3:.1f}" '
                           f'text-anchor="middle" fill="white" font-weight="bold">rank {r}</text>')
                out.append(f'<text x="{x + w / 2:.1f}" y="{y + h / 2 + 11:.1f}" '
                           f'text-anchor="middle" fill="white">dp {dp}, tp {tp}</text>')
        for tp in range(t):  # the TP cut, drawn heavier
            if tp_cols and tp:
                x = x0 + cell * tp / t
                out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + cell}" '
                           'stroke="black" stroke-width="3"/>')
            if not tp_cols and tp:
                y = top + cell * tp / t
                out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + cell}" y2="{y:.1f}" '
                           'stroke="black" stroke-width="3"/>')
        held = "[⌈H/D⌉, NH·Dh/T]" if tp_cols else "[⌈NH·Dh/(T·D)⌉, H]"
        out.append(f'<text x="{x0}" y="{top + cell + 18}">each rank stores {escape(held)}</text>')
    notes = ["thick line: the TP cut (fixed for the whole step); thin lines: the FSDP cut (gathered "
             "over the DP group just before the layer runs)",
             "a DP group (same tp, every dp) all-gathers its column band (Wq) or row band (Wo) "
             "back into the TP shard stage 05 computes with",
             "every parameter, gradient and optimizer moment is stored this way: 1/(T·D) of it on "
             "each rank"]
    for i, note in enumerate(notes):
        out.append(f'<text x="10" y="{height - 60 + 18 * i}" fill="#555">{escape(note)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def ring_figure(c):
    """Stage 08's ring of C CP ranks: at step s rank i holds the K/V block of rank (i − s) mod C
    and sends it on to i + 1; in backward each block's dK/dV partial travels with it and one more
    hop, after step C − 1, brings it home."""
    cell_w, cell_h, left, top, gap = 130, 40, 170, 84, 16
    width = left + c * (cell_w + gap) + 20
    height = top + (c + 1) * (cell_h + gap) + 110
    title = (f"stage 08: the K/V ring over C = {c} CP ranks (each block coloured by the rank "
             "that owns it)")
    subtitle = ("at step s CP rank i attends to the K/V block of rank (i − s) mod C while "
                "sending it on to rank i + 1")
    out = svg_head(width, height, title, subtitle)
    for i in range(c):
        x = left + i * (cell_w + gap)
        out.append(f'<text x="{x + cell_w / 2}" y="{top - 10}" text-anchor="middle" '
                   f'font-weight="bold">cp rank {i}</text>')
    for s in range(c + 1):
        y = top + s * (cell_h + gap)
        last = s == c
        label = f"step {s}" if not last else "one hop more"
        out.append(f'<text x="10" y="{y + 17}" font-weight="bold">{escape(label)}</text>')
        sub = ("attend, K/V hop on" if s < c - 1 else "attend, no K/V hop") if not last \
            else "backward only"
        out.append(f'<text x="10" y="{y + 32}" fill="#555">{escape(sub)}</text>')
        for i in range(c):
            x = left + i * (cell_w + gap)
            if last:  # the dK/dV of each block back at its owner
                owner = i
                text = f"dK/dV of {owner} home"
                out.append(f'<rect x="{x}" y="{y}" width="{cell_w}" height="{cell_h}" '
                           f'fill="white" stroke="{COLORS[owner]}" stroke-width="3"/>')
                out.append(f'<text x="{x + cell_w / 2}" y="{y + 24}" text-anchor="middle" '
                           f'fill="{COLORS[owner]}" font-weight="bold">{escape(text)}</text>')
                continue
            owner = (i - s) % c
            out.append(f'<rect x="{x}" y="{y}" width="{cell_w}" height="{cell_h}" '
                       f'fill="{COLORS[owner]}" fill-opacity="0.8"/>')
            out.append(f'<text x="{x + cell_w / 2}" y="{y + 17}" text-anchor="middle" '
                       f'fill="white">K/V of rank {owner}</text>')
            pairs = "own block: diagonal" if owner == i else "other's block"
            out.append(f'<text x="{x + cell_w / 2}" y="{y + 32}" text-anchor="middle" '
                       f'fill="white">{escape(pairs)}</text>')
        if s >= c:
            continue
        # The hop after step s: i → i + 1, into the next row (K/V for s < C − 1; in backward the
        # dK/dV partial travels with the block, and after step C − 1 it alone goes home).
        dk_only = s == c - 1
        colour = "#d62728" if dk_only else "#555"
        for i in range(c):
            x1 = left + i * (cell_w + gap) + cell_w / 2
            j = (i + 1) % c
            x2 = left + j * (cell_w + gap) + cell_w / 2
            y1, y2 = y + cell_h, y + cell_h + gap
            if j == 0:  # the wrap-around: drawn as a short stub out of the last column
                out.append(f'<path d="M {x1 + 20:.1f} {y1} L {x1 + cell_w / 2 + 4:.1f} {y2 - 2}" '
                           f'stroke="{colour}" stroke-width="1.5" stroke-dasharray="4 2" '
                           'fill="none" marker-end="url(#arrow)"/>')
                out.append(f'<path d="M {left - 6:.1f} {y1 + 2} L {x2 - 20:.1f} {y2 - 1}" '
                           f'stroke="{colour}" stroke-width="1.5" stroke-dasharray="4 2" '
                           'fill="none" marker-end="url(#arrow)"/>')
            else:
                out.append(f'<line x1="{x1 + 20:.1f}" y1="{y1}" x2="{x2 - 20:.1f}" y2="{y2 - 1}" '
                           f'stroke="{colour}" stroke-width="1.5" marker-end="url(#arrow)"/>')
    notes = [f"grey arrows: a hop of K/V (forward and backward; in backward the block's dK/dV "
             f"partial rides along): C − 1 = {c - 1} hops",
             f"red arrows: after the last step only the dK/dV partials move, one hop more, to the "
             f"block's owner: C = {c} dK/dV hops in all",
             "the dashed arrows wrap around the ring: the last rank sends to rank 0",
             "each rank holds two K/V blocks at a time (the one it attends to, the one arriving), "
             "whatever C is"]
    for i, note in enumerate(notes):
        out.append(f'<text x="10" y="{height - 76 + 18 * i}" fill="#555">{escape(note)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def ulysses_figure(c, heads):
    """Stage 08's Ulysses all-to-all at C ranks: q (or k, v, o) as a grid of 2C sequence chunks by
    `heads` heads, coloured by the rank that holds each cell, before and after the switch."""
    chunks = 2 * c
    cw, ch, top, gapx = 60, 30, 100, 200
    grid_w = heads * cw
    left = 80
    width = max(left + 2 * grid_w + gapx + 40, 900)
    height = top + chunks * ch + 120
    title = (f"stage 08: Ulysses' all-to-all at C = {c}: sequence shards become head shards "
             f"({heads} heads of one TP rank)")
    subtitle = ("a cell is one sequence chunk of one head, coloured by the CP rank that holds it; "
                "a cell whose colour changes moves")
    out = svg_head(width, height, title, subtitle)

    def owner_seq(chunk):  # chunks i and 2C−1−i on rank i
        return chunk if chunk < c else chunks - 1 - chunk

    def owner_head(h):
        return h // (heads // c)

    for k, (name, owner) in enumerate([("before: the sequence in 2C chunks, rank i holds chunks "
                                        "i and 2C−1−i, every head", lambda q, h: owner_seq(q)),
                                       ("after: the whole sequence, rank r holds heads "
                                        f"{heads // c}r … {heads // c}r+{heads // c - 1}",
                                        lambda q, h: owner_head(h))]):
        x0 = left + k * (grid_w + gapx)
        for line, part in enumerate([name.split(", ", 1)[0] + ",", name.split(", ", 1)[1]]):
            out.append(f'<text x="{x0}" y="{top - 30 + 14 * line}" font-weight="bold">'
                       f'{escape(part)}</text>')
        for h in range(heads):
            out.append(f'<text x="{x0 + h * cw + cw / 2}" y="{top - 4}" text-anchor="middle" '
                       f'fill="#555">h{h}</text>')
        for q in range(chunks):
            y = top + q * ch
            if k == 0:
                out.append(f'<text x="10" y="{y + 17}">chunk {q}</text>')
            for h in range(heads):
                r = owner(q, h)
                stays = owner_seq(q) == owner_head(h)
                out.append(f'<rect x="{x0 + h * cw}" y="{y}" width="{cw}" height="{ch}" '
                           f'fill="{COLORS[r]}" fill-opacity="{0.95 if stays else 0.55}" '
                           'stroke="white"/>')
                if stays:
                    out.append(f'<text x="{x0 + h * cw + cw / 2}" y="{y + 17}" '
                               'text-anchor="middle" fill="white">stays</text>')
    mid_y = top + chunks * ch / 2
    ax0, ax1 = left + grid_w + 20, left + grid_w + gapx - 20
    out.append(f'<line x1="{ax0}" y1="{mid_y}" x2="{ax1}" y2="{mid_y}" stroke="#555" '
               'stroke-width="2" marker-end="url(#arrow)"/>')
    out.append(f'<text x="{(ax0 + ax1) / 2}" y="{mid_y - 10}" text-anchor="middle">all-to-all'
               '</text>')
    out.append(f'<text x="{(ax0 + ax1) / 2}" y="{mid_y + 18}" text-anchor="middle" fill="#555">'
               'rank i sends rank r</text>')
    out.append(f'<text x="{(ax0 + ax1) / 2}" y="{mid_y + 32}" text-anchor="middle" fill="#555">'
               "its chunks of r's heads</text>")
    for r in range(c):
        out.append(f'<rect x="{10 + 90 * r}" y="{height - 92}" width="12" height="12" '
                   f'fill="{COLORS[r]}" fill-opacity="0.8"/>')
        out.append(f'<text x="{26 + 90 * r}" y="{height - 82}">cp rank {r}</text>')
    notes = [f"stays: the cells a rank already holds (1/C of them); the other (C − 1)/C = "
             f"{c - 1}/{c} cross the CP group",
             "attention then runs per head over the whole sequence in its natural order, and a "
             "second all-to-all takes the output back",
             "it needs NKV % (C·T) == 0: each rank must hold whole KV heads after the switch"]
    for i, note in enumerate(notes):
        out.append(f'<text x="10" y="{height - 56 + 18 * i}" fill="#555">{escape(note)}</text>')
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
                          ("02_gqa_replicated_np4.svg", gqa_replicated_figure(8, 2, 4)),
                          ("07_fsdp_tp_cut_np4.svg", fsdp_tp_figure(2, 2)),
                          ("08_ring_cp4.svg", ring_figure(4)),
                          ("08_ulysses_cp2.svg", ulysses_figure(2, 4)),
                          ("02_vocab_parallel_ce_np4.svg", vocab_svg.figure())]:
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
