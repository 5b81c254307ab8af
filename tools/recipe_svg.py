#!/usr/bin/env python3
"""Draws chapter 6's figure of the low-precision recipes' scales over one matrix, as SVG.

The input is what tools/lowp_layouts prints (build/bin/lowp_layouts): one operand matrix, R rows
by K columns along the reduction, quantized by lowp::quantize under each recipe (common/lowp.h).
Each panel draws the matrix to scale, one square cell per element, cut into the recipe's blocks;
each block is one scale, shaded by its dequantization factor (darker: a larger factor, so
coarser steps; the block that holds the matrix's one outlier is the darkest of its panel). Beside
each panel: the element and scale formats, the block, the number of scales and their bytes, all
read from the input, none typed here.

Usage: tools/recipe_svg.py LAYOUTS.json [--title T] -o OUT.svg
Only the standard library.
"""
import argparse
import json
import math
import pathlib
from xml.sax.saxutils import escape

import tool_errors

CELL = 4  # pixels per element, both ways: the matrix to scale
LEFT, TOP = 20, 76
LINE = 15  # a line of text
GAP = 22
LIGHT, DARK = (0xE8, 0xF0, 0xFA), (0x1F, 0x4E, 0x8C)

NAMES = {
    ("tensorwise", "activation"): "tensorwise",
    ("rowwise", "activation"): "rowwise",
    ("block128", "activation"): "block128, activations and gradients",
    ("block128", "weight"): "block128, weights",
    ("mxfp8", "activation"): "mxfp8",
    ("nvfp4", "activation"): "nvfp4",
}


def shade(t):
    """The colour at t in [0, 1], light to dark."""
    return "#" + "".join(f"{round(a + (b - a) * t):02x}" for a, b in zip(LIGHT, DARK))


def block_text(p, rows, cols):
    br = p["block_rows"] or rows
    bc = p["block_cols"] or cols
    if p["block_rows"] == 0:
        return "one block: the whole matrix"
    if p["block_cols"] == 0:
        return f"blocks of 1 × {cols}: one per row"
    return f"blocks of {br} × {bc}"


def per_element(nbytes, n):
    return f"{nbytes / n:.4g}"


def panel(p, rows, cols, outlier, y):
    n = rows * cols
    name = NAMES.get((p["recipe"], p["operand"]), p["recipe"])
    element = p["element"]
    if p["gradient_element"] != element:
        element += f" ({p['gradient_element']} for gradients)"
    scale = p["scale"] + " scale"
    if p["tensor_scale"] is not None:
        scale += " per block and one fp32 per tensor (s_enc)"
    nscales = p["scale_rows"] * p["scale_cols"]
    code_b = p["code_bytes"] / n
    line1 = (f"<tspan font-weight='bold'>{escape(name)}</tspan>: elements {escape(element)}, "
             f"{p['element_bits']} bits; {escape(scale)}; {escape(block_text(p, rows, cols))}")
    line2 = (f"{p['scale_rows']} × {p['scale_cols']} = {nscales} scale{'s' if nscales > 1 else ''}"
             f"{' + s_enc' if p['tensor_scale'] is not None else ''}: "
             f"{p['scale_bytes']} B of scales = {per_element(p['scale_bytes'], n)} B per element"
             f" (codes {code_b:g} B per element; lowp::storage_bytes {p['storage_bytes']} B)")
    lines = [f'<text x="{LEFT}" y="{y + LINE}">{line1}</text>',
             f'<text x="{LEFT}" y="{y + 2 * LINE}" fill="#444">{escape(line2)}</text>']
    whole = p["whole_blocks"]
    if (whole["rows"], whole["cols"]) != (rows, cols):
        wn = whole["rows"] * whole["cols"]
        line3 = (f"(these {rows} rows are the top of one band of partial blocks; whole blocks, "
                 f"{whole['rows']} × {whole['cols']} elements, carry {whole['scale_bytes']} B of "
                 f"scales, {per_element(whole['scale_bytes'], wn)} B per element)")
        lines.append(f'<text x="{LEFT}" y="{y + 3 * LINE}" fill="#444">{escape(line3)}</text>')
    out = lines
    my = y + len(lines) * LINE + 6
    factors = p["factors"]
    if len(factors) != nscales:
        tool_errors.fail(f"{p['recipe']}: {len(factors)} factors for {nscales} scales")
    logs = [math.log2(f) if f > 0 and math.isfinite(f) else None for f in factors]
    finite = [v for v in logs if v is not None]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    br = p["block_rows"] or rows
    bc = p["block_cols"] or cols
    for sr in range(p["scale_rows"]):
        for sc in range(p["scale_cols"]):
            v = logs[sr * p["scale_cols"] + sc]
            t = 0.5 if v is None or hi == lo else 0.15 + 0.85 * (v - lo) / (hi - lo)
            r0, c0 = sr * br, sc * bc
            h = min(rows, r0 + br) - r0
            w = min(cols, c0 + bc) - c0
            out.append(f'<rect x="{LEFT + c0 * CELL}" y="{my + r0 * CELL}" width="{w * CELL}" '
                       f'height="{h * CELL}" fill="{shade(t)}" stroke="white" '
                       f'stroke-width="1"/>')
    out.append(f'<rect x="{LEFT + outlier["col"] * CELL}" y="{my + outlier["row"] * CELL}" '
               f'width="{CELL}" height="{CELL}" fill="#d62728"/>')
    out.append(f'<rect x="{LEFT}" y="{my}" width="{cols * CELL}" height="{rows * CELL}" '
               'fill="none" stroke="#000" stroke-width="1.2"/>')
    return out, my + rows * CELL + GAP


def figure(d, title):
    rows, cols = d["rows"], d["cols"]
    if rows * cols > 4096:
        tool_errors.fail(f"a {rows} × {cols} matrix has more cells than one figure draws (4096)")
    width = max(LEFT * 2 + cols * CELL, 900)
    body, y = [], TOP
    for p in d["panels"]:
        lines, y = panel(p, rows, cols, d["outlier"], y)
        body += lines
    height = y + 30
    o = d["outlier"]
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            'font-family="sans-serif" font-size="11">',
            f"<title>{escape(title)}</title>",
            f'<rect width="{width}" height="{height}" fill="white"/>',
            f'<text x="{LEFT}" y="22" font-size="14" font-weight="bold">{escape(title)}</text>',
            f'<text x="{LEFT}" y="40" fill="#444">one operand, {rows} rows × {cols} along K (the '
            f'reduction), drawn to scale: one {CELL} × {CELL} px square per element; each tile '
            'between white lines is one block, one scale. Its shade is the block\'s</text>',
            f'<text x="{LEFT}" y="54" fill="#444">dequantization factor (what a code of 1 stands '
            'for: 1 / scale, the E8M0 power of two, or decode(d_b) / s_enc), darker = larger = '
            'coarser steps, on a log scale within each panel.</text>',
            f'<text x="{LEFT}" y="68" fill="#444">The red cell is the one outlier, '
            f'{o["value"]:g} at row {o["row"]}, column {o["col"]}, among values of magnitude below '
            '1: it coarsens every element that shares its scale.</text>']
    foot = [f'<text x="{LEFT}" y="{height - 12}" fill="#666">numbers from lowp::quantize and '
            'lowp::storage_bytes (common/lowp.h) by build/bin/lowp_layouts; drawn by '
            'tools/recipe_svg.py</text>', "</svg>"]
    return "\n".join(head + body + foot) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("layouts", help="the JSON lowp_layouts prints")
    ap.add_argument("--title", default="the low-precision recipes' scales over one matrix")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    d = json.loads(pathlib.Path(a.layouts).read_text(encoding="utf-8"))
    pathlib.Path(a.out).write_text(figure(d, a.title), encoding="utf-8")
    return 0


if __name__ == "__main__":
    tool_errors.run(main, "recipe_svg")
