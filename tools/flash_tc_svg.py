#!/usr/bin/env python3
"""Draws chapter 1's figure of the tensor-core attention kernels, as SVG.

Three panels, the three ideas of the section "The tensor-core kernels" of 01_baseline/README.md:

  1. the work of one block of the forward: its 64 query rows over 4 warps, 16 rows each, the
     K and V tiles of 64 keys shared in shared memory, and each warp's 16×64 scores Z = Q·Kᵀ in
     its own accumulator registers;
  2. the C → A reuse: the two 16×8 C fragments (fp32) of mma.m16n8k16 that hold 16 columns of
     scores are, register for register, the 16×16 A fragment of the next product P·V once
     rounded to bf16 (lane = 4·g + t holds rows g and g + 8, columns 2t and 2t + 1 of each 8);
  3. the two-buffer cp.async pipeline: tile t + 1 is copied into the other buffer while tile t's
     products run, with the wait and the two barriers of each step;
  4. the backward's dQ: each key block's step computes its share of a query tile's dQ, and the
     key blocks add their shares to the fp32 accumulator in turn, key block 0 first, each waiting
     for the tile's counter to read its own index.

Usage: tools/flash_tc_svg.py [-o OUT.svg]     (default: docs/figures/01_flash_tc.svg)
       tools/flash_tc_svg.py --check          (exits 1 if the committed figure is not what it draws)
Only the standard library.
"""
import argparse
import pathlib
import sys
from xml.sax.saxutils import escape

import tool_errors

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "figures" / "01_flash_tc.svg"
WARPS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2"]  # warp 0 … 3
SHARED = "#9d9d9d"
BUFFERS = ["#72b7b2", "#e45756"]  # shared-memory buffer 0 and 1
GREY = "#555"
WIDTH, HEIGHT = 1000, 1265


def text(x, y, s, **attrs):
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f'<text x="{x}" y="{y}"{extra}>{escape(s)}</text>'


def rect(x, y, w, h, fill, opacity=0.8, stroke=None, dash=None):
    s = f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{fill}" fill-opacity="{opacity}"'
    if stroke:
        s += f' stroke="{stroke}"'
    if dash:
        s += f' stroke-dasharray="{dash}"'
    return s + "/>"


def arrow(x0, y0, x1, y1, color=GREY):
    return (f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y1}" stroke="{color}" stroke-width="1.5" '
            'marker-end="url(#arrow)"/>')


def panel_tiles(top):
    """Panel 1: one forward block, its 64 query rows over 4 warps, and one key tile."""
    out = [text(10, top, "1. One block of the forward at Dh = 128: 64 query rows, 4 warps of 16 "
                "rows (32 at Dh = 32, 64), one key tile of 64 at a time", font_size=13,
                font_weight="bold")]
    y0 = top + 40
    row_h = 22  # one warp's 16 rows
    # Q: 64 rows × Dh, each warp's 16 rows in its colour (registers: its own A fragments).
    qx, qw = 20, 120
    out.append(text(qx + qw / 2, y0 - 8, "Q rows (64 × Dh)", text_anchor="middle"))
    for w in range(4):
        out.append(rect(qx, y0 + w * row_h, qw, row_h, WARPS[w]))
        out.append(text(qx + qw / 2, y0 + w * row_h + 15, f"warp {w}: rows {16 * w}–{16 * w + 15}",
                        text_anchor="middle", fill="white"))
    # K tile (64 keys × Dh) and V tile in shared memory, read by every warp.
    kx, kw = 210, 150
    out.append(text(kx + kw / 2, y0 - 8, "K tile t (64 keys × Dh)", text_anchor="middle"))
    out.append(rect(kx, y0, kw, 4 * row_h, SHARED, 0.35, stroke=GREY))
    out.append(text(kx + kw / 2, y0 + 38, "shared memory,", text_anchor="middle"))
    out.append(text(kx + kw / 2, y0 + 54, "read by all 4 warps", text_anchor="middle"))
    out.append(text(kx + kw / 2, y0 + 70, "(ldmatrix)", text_anchor="middle", fill=GREY))
    out.append(text(kx - 25, y0 + 2 * row_h + 5, "·", font_size=22, text_anchor="middle"))
    # Z = Q·Kᵀ: 64 × 64, each warp's 16×64 strip in that warp's registers.
    zx, zw = 440, 210
    out.append(text(zx - 40, y0 + 2 * row_h + 5, "=", font_size=18, text_anchor="middle"))
    out.append(text(zx + zw / 2, y0 - 8, "Z = Q·Kᵀ/√Dh (64 × 64 of this tile)",
                    text_anchor="middle"))
    for w in range(4):
        out.append(rect(zx, y0 + w * row_h, zw, row_h, WARPS[w], 0.55, stroke="white"))
        out.append(text(zx + zw / 2, y0 + w * row_h + 15, f"16 × 64 in warp {w}'s registers",
                        text_anchor="middle"))
    # V tile, then O: each warp's 16 rows of the output accumulator.
    vx = 700
    out.append(text(vx + 60, y0 - 8, "then O += P·V", text_anchor="middle"))
    out.append(rect(vx, y0, 120, 4 * row_h, SHARED, 0.35, stroke=GREY))
    out.append(text(vx + 60, y0 + 38, "V tile t", text_anchor="middle"))
    out.append(text(vx + 60, y0 + 54, "(shared, all warps)", text_anchor="middle"))
    ox = 850
    out.append(text(ox + 60, y0 - 8, "O (64 × Dh, fp32)", text_anchor="middle"))
    for w in range(4):
        out.append(rect(ox, y0 + w * row_h, 120, row_h, WARPS[w], 0.55, stroke="white"))
        out.append(text(ox + 60, y0 + w * row_h + 15, f"warp {w}'s registers",
                        text_anchor="middle"))
    notes = ["A warp owns its 16 rows from start to end: its row max and row sum need only the 4 "
             "lanes that hold a row (two __shfl_xor_sync), never another warp.",
             "The warps share only the K and V tiles (and never write them); the backward is laid "
             "out the other way round (16 keys a warp, 32-row query tiles: panel 4)."]
    for i, n in enumerate(notes):
        out.append(text(20, y0 + 4 * row_h + 26 + 16 * i, n, fill=GREY))
    return out, y0 + 4 * row_h + 60


def fragment(x, y, cw, ch, cols, label_of, fill_of, title, sub=None):
    """A 16-row fragment of `cols` columns drawn as cells, with the registers of lane 0 labelled."""
    out = [text(x + cols * cw / 2, y - 20, title, text_anchor="middle", font_weight="bold")]
    if sub:
        out.append(text(x + cols * cw / 2, y - 6, sub, text_anchor="middle", fill=GREY))
    for r in range(16):
        for c in range(cols):
            label = label_of(r, c)
            opacity = 0.85 if label else 0.18
            out.append(rect(x + c * cw, y + r * ch, cw, ch, fill_of(c), opacity, stroke="white"))
            if label:
                out.append(text(x + c * cw + cw / 2, y + r * ch + ch - 3, label,
                                text_anchor="middle", fill="white", font_size=9))
    return out


def panel_registers(top):
    """Panel 2: two C fragments (16×8 fp32) are one A fragment (16×16 bf16), lane 0 shown."""
    out = [text(10, top, "2. A product's result is the next product's operand, in the same "
                "registers", font_size=13, font_weight="bold"),
           text(10, top + 18, "lane = 4·g + t of a warp holds rows g and g + 8, columns 2t and "
                "2t + 1 of each 8 columns; lane 0's registers are labelled, every lane's are "
                "placed alike", fill=GREY)]
    y = top + 70
    cw, ch = 20, 11

    def c_label(r, c):  # lane 0: g = 0, t = 0
        names = {(0, 0): "c0", (0, 1): "c1", (8, 0): "c2", (8, 1): "c3"}
        return names.get((r, c), "")

    def a_label(r, c):
        lo = {(0, 0): "a0", (0, 1): "a1", (8, 0): "a2", (8, 1): "a3"}
        hi = {(0, 8): "a4", (0, 9): "a5", (8, 8): "a6", (8, 9): "a7"}
        return lo.get((r, c)) or hi.get((r, c), "")

    x_lo, x_hi = 30, 230
    lo, hi = WARPS[0], WARPS[1]
    out += fragment(x_lo, y, cw, ch, 8, c_label, lambda c: lo, "scores, columns 0–7",
                    "a C fragment of Q·Kᵀ (fp32)")
    out += fragment(x_hi, y, cw, ch, 8, c_label, lambda c: hi, "scores, columns 8–15",
                    "the next C fragment (fp32)")
    x_a = 560
    out += fragment(x_a, y, cw, ch, 16, a_label, lambda c: lo if c < 8 else hi,
                    "P, 16 × 16: the A operand of P·V", "one A fragment (bf16), columns 0–15")
    mid = y + 8 * ch
    out.append(arrow(x_hi + 8 * cw + 20, mid, x_a - 20, mid))
    out.append(text((x_hi + 8 * cw + x_a) / 2, mid - 24, "exp2 in place, then", text_anchor="middle"))
    out.append(text((x_hi + 8 * cw + x_a) / 2, mid - 10, "each pair to bf16", text_anchor="middle"))
    out.append(text((x_hi + 8 * cw + x_a) / 2, mid + 18, "a0..a3 = c0..c3 of 0–7", text_anchor="middle",
                    fill=GREY))
    out.append(text((x_hi + 8 * cw + x_a) / 2, mid + 32, "a4..a7 = c0..c3 of 8–15",
                    text_anchor="middle", fill=GREY))
    notes = ["No shuffle and no trip through shared memory. The softmax works on these fragments, "
             "so it must know which element each register holds,",
             "which WMMA's opaque fragments hide: hence mma.sync in inline PTX. In backward dZ "
             "becomes the operand of dZ·K the same way."]
    for i, n in enumerate(notes):
        out.append(text(20, y + 16 * ch + 24 + 16 * i, n, fill=GREY))
    return out, y + 16 * ch + 66


def panel_pipeline(top):
    """Panel 3: the two-buffer cp.async pipeline of the key tiles."""
    out = [text(10, top, "3. The pipeline: tile t + 1 is copied into the other buffer while tile "
                "t's products run (cp.async: global → shared, no registers)", font_size=13,
                font_weight="bold")]
    left, step, y_copy, y_mma, h = 250, 172, top + 50, top + 100, 30
    out.append(text(10, y_copy + 20, "copies (cp.async)", font_weight="bold"))
    out.append(text(10, y_mma + 20, "products (mma.sync)", font_weight="bold"))
    tiles = 4
    copy_w, pad = 110, 14
    # The prologue: the block's own Q rows and tile 0, one group, into buffer 0.
    px, pw = left - 106, 96
    out.append(rect(px, y_copy, pw, h, BUFFERS[0]))
    out.append(text(px + pw / 2, y_copy + 19, "Q + tile 0 → buf 0", text_anchor="middle",
                    fill="white", font_size=10))
    out.append(text(px + pw / 2, y_copy - 8, "before the loop", text_anchor="middle", fill=GREY))
    for t in range(tiles):
        x = left + t * step
        b = t % 2
        # Step t: issue tile t + 1 into the other buffer, wait for tile t, barrier, products.
        if t + 1 < tiles:
            out.append(rect(x + 4, y_copy, copy_w, h, BUFFERS[1 - b]))
            out.append(text(x + 4 + copy_w / 2, y_copy + 19, f"tile {t + 1} → buf {1 - b}",
                            text_anchor="middle", fill="white"))
        else:
            out.append(text(x + 4 + copy_w / 2, y_copy + 19, "(empty group)",
                            text_anchor="middle", fill=GREY))
        out.append(rect(x + pad, y_mma, step - 2 * pad, h, BUFFERS[b]))
        out.append(text(x + step / 2, y_mma + 19, f"tile {t} on buf {b}", text_anchor="middle",
                        fill="white"))
        # The wait and barrier before the products, the barrier after them.
        for bx, dash in ((x + pad - 5, "4,3"), (x + step - pad + 5, "1,3")):
            out.append(f'<line x1="{bx}" y1="{y_copy - 8}" x2="{bx}" y2="{y_mma + h + 8}" '
                       f'stroke="#333" stroke-width="1.5" stroke-dasharray="{dash}"/>')
        out.append(text(x + step / 2, y_mma + h + 22, f"step t = {t}", text_anchor="middle",
                        fill=GREY))
    x_end = left + tiles * step
    out.append(arrow(left - 20, y_mma + h + 40, x_end + 20, y_mma + h + 40))
    out.append(text(x_end + 24, y_mma + h + 44, "time"))
    # The legend of the lines and the buffers.
    ly = y_mma + h + 70
    out.append(f'<line x1="20" y1="{ly - 4}" x2="50" y2="{ly - 4}" stroke="#333" '
               'stroke-width="1.5" stroke-dasharray="4,3"/>')
    out.append(text(58, ly, "commit the copies as one group; cp.async.wait_group 1 (every group "
                    "but the newest has landed: tile t has) and __syncthreads (for every thread's "
                    "copies)"))
    out.append(f'<line x1="20" y1="{ly + 16}" x2="50" y2="{ly + 16}" stroke="#333" '
               'stroke-width="1.5" stroke-dasharray="1,3"/>')
    out.append(text(58, ly + 20, "__syncthreads: nobody reads buffer t mod 2 any more, so step "
                    "t + 1 may copy tile t + 2 into it"))
    for i, (c, name) in enumerate(zip(BUFFERS, ["shared-memory buffer 0", "buffer 1"])):
        out.append(rect(20 + 200 * i, ly + 34, 14, 14, c))
        out.append(text(40 + 200 * i, ly + 46, name))
    out.append(text(430, ly + 46, "(K and V here; Q and dO in the backward)", fill=GREY))
    return out, ly + 60


def panel_turns(top):
    """Panel 4: the backward's five products per step, and dQ's shares added in turn."""
    out = [text(10, top, "4. The backward at Dh = 128: one block per 64 keys, five products per "
                "step, and dQ's shares added in a fixed order", font_size=13, font_weight="bold")]
    # Left: one key block's step on one query tile.
    y = top + 34
    steps = [("Sᵀ = K·Qᵀ,  dPᵀ = V·dOᵀ", "registers: each warp its 16 keys × 32 queries"),
             ("dV += Pᵀ·dO,  dK += dSᵀ·Q", "registers, summed over the step's tiles and heads"),
             ("dSᵀ → shared memory", "the 4 warps' 64 × 32, rounded to bf16"),
             ("dQ share = dS·K", "32 query rows × Dh, each warp a quarter")]
    for i, (what, where) in enumerate(steps):
        yy = y + i * 44
        out.append(rect(20, yy, 230, 30, WARPS[i], opacity=0.85))
        out.append(text(135, yy + 19, what, text_anchor="middle", fill="white", font_weight="bold"))
        out.append(text(260, yy + 19, where, fill=GREY))
        if i + 1 < len(steps):
            out.append(arrow(135, yy + 30, 135, yy + 43))
    out.append(text(20, y + 4 * 44 + 6, "key block j's step on query tile i (one head of the "
                    "group)", fill=GREY))
    # Right: the accumulator of one query tile, the key blocks' shares arriving in turn.
    ax, ay, aw, ah = 600, top + 40, 360, 36
    out.append(rect(ax, ay, aw, ah, SHARED, opacity=0.35, stroke="#333"))
    out.append(text(ax + aw / 2, ay + 15, "dQ of query tile i (fp32, global memory)",
                    text_anchor="middle", font_weight="bold"))
    out.append(text(ax + aw / 2, ay + 30, "counter of tile i: 0 → 1 → 2 → 3",
                    text_anchor="middle"))
    for j in range(3):
        bx, by = ax + j * 124, ay + 120
        out.append(rect(bx, by, 112, 34, WARPS[j], opacity=0.85))
        out.append(text(bx + 56, by + 14, f"key block {j}", text_anchor="middle", fill="white",
                        font_weight="bold"))
        out.append(text(bx + 56, by + 28, f"its turn: {j}", text_anchor="middle", fill="white",
                        font_size=10))
        out.append(arrow(bx + 56, by, bx + 56, ay + ah + 4, WARPS[j]))
        out.append(text(bx + 62, by - 40, f"wait for {j},", fill=WARPS[j]))
        out.append(text(bx + 62, by - 27, f"add, set {j + 1}", fill=WARPS[j]))
    notes = ["Each key block adds its share at its own turn, key block 0 first, so the sum is the "
             "same bits on every run (atomic adds would sum in arrival order).",
             "A block takes its key block from a ticket when it starts (ticket t: key block "
             "t / KV heads), so the blocks it waits for have started: the wait cannot deadlock.",
             "Five products per step, where a dQ kernel beside a dK/dV kernel, each recomputing "
             "S and dP, took seven."]
    ny = max(y + 4 * 44 + 30, ay + 175)
    for i, line in enumerate(notes):
        out.append(text(20, ny + 16 * i, line, fill=GREY))
    return out, ny + 16 * len(notes)


def figure():
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           'font-family="sans-serif" font-size="11">',
           '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="7" refY="4" '
           f'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="{GREY}"/></marker></defs>',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           text(10, 22, "stage 01: the tensor-core attention kernels "
                "(common/cuda/flash_attention.cu), bf16 operands, 128 threads a block",
                font_size=15, font_weight="bold")]
    y = 60
    for panel in (panel_tiles, panel_registers, panel_pipeline, panel_turns):
        part, y = panel(y)
        out += part
        y += 40
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", default=str(OUT))
    ap.add_argument("--check", action="store_true",
                    help="compare the committed figure with what this draws; write nothing")
    a = ap.parse_args()
    svg = figure()
    if a.check:
        if not OUT.exists() or OUT.read_text() != svg:
            print(f"{OUT.relative_to(ROOT)}: stale; regenerate with tools/flash_tc_svg.py",
                  file=sys.stderr)
            return 1
        return 0
    pathlib.Path(a.out).write_text(svg)
    return 0


if __name__ == "__main__":
    tool_errors.run(main, "flash_tc_svg")
