#!/usr/bin/env python3
"""Draws a reshard as SVG: one global tensor cut two ways, and the bytes a loading rank reads.

Given two checkpoints of the same model (common/checkpoint.h's layout: a step directory with an
index.json), one saved on the mesh a run saved on and one saved on the mesh that loads it (its
boxes are that mesh's cut, the same state_parts() a resume asks), the figure has three panels:

  1. the global tensor with the saved mesh's shards, one colour per shard file;
  2. the same tensor with the loading mesh's boxes, the loading rank's filled with the parts of
     the saved shards it overlaps (common/checkpoint.cc's overlap());
  3. each saved shard file that holds some of it, as a bar of its bytes: the tensor's shard in
     it, and the runs of bytes inside that the rank needs (each a row of the overlap, row-major);
     the loader reads from the first to the last of them, rounded out to the file's checksummed
     chunks (chunk_bytes in the index).

Usage: tools/checkpoint_svg.py SAVED_STEP_DIR LOADING_STEP_DIR --tensor NAME --rank R
           [--saved LABEL] [--loaded LABEL] [--title TITLE] -o OUT.svg
Only the standard library.
"""
import argparse
import json
import pathlib
from xml.sax.saxutils import escape

import tool_errors

COLORS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#eeca3b", "#9d755d"]


def read_index(step_dir):
    path = pathlib.Path(step_dir) / "index.json"
    index = json.loads(path.read_text())
    if index.get("format") != "tpx-checkpoint":
        tool_errors.fail(f"not a tpx checkpoint index: {path}")
    return index


def tensor_of(index, name, where):
    for t in index["tensors"]:
        if t["name"] == name:
            return t
    tool_errors.fail(f"no tensor '{name}' in {where}/index.json")


def as_2d(shape, box):
    """A 1-D tensor as one row: (rows, cols) and the box as ((r0, nr), (c0, nc))."""
    if len(shape) == 1:
        return (1, shape[0]), ((0, 1), tuple(box[0]))
    if len(shape) != 2:
        tool_errors.fail(f"a tensor of {len(shape)} dimensions (the figure draws 1 or 2)")
    return tuple(shape), (tuple(box[0]), tuple(box[1]))


def overlap(a, b):
    out = []
    for (s1, n1), (s2, n2) in zip(a, b):
        lo, hi = max(s1, s2), min(s1 + n1, s2 + n2)
        if hi <= lo:
            return None
        out.append((lo, hi - lo))
    return tuple(out)


def runs(shard_box, part):
    """The byte runs [start, end) within the shard's bytes that hold `part` (row-major, fp32),
    adjacent runs merged."""
    (r0, _), (c0, nc) = shard_box
    (pr, pnr), (pc, pnc) = part
    out = []
    for r in range(pr, pr + pnr):
        start = ((r - r0) * nc + (pc - c0)) * 4
        end = start + pnc * 4
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def file_rank(name):
    return int(name.removeprefix("rank-").removesuffix(".bin"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("saved")
    ap.add_argument("loading")
    ap.add_argument("--tensor", required=True)
    ap.add_argument("--rank", type=int, required=True, help="the loading rank (its rank-R.bin)")
    ap.add_argument("--saved-label", default="saved")
    ap.add_argument("--loaded-label", default="loading")
    ap.add_argument("--title", default="")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()

    saved_index, loading_index = read_index(a.saved), read_index(a.loading)
    saved = tensor_of(saved_index, a.tensor, a.saved)
    loading = tensor_of(loading_index, a.tensor, a.loading)
    if saved["shape"] != loading["shape"]:
        tool_errors.fail(f"'{a.tensor}' is {saved['shape']} in {a.saved}, "
                         f"{loading['shape']} in {a.loading}")
    (rows, cols), _ = as_2d(saved["shape"], [[0, 1]] * len(saved["shape"]))
    saved_shards = [(sh, as_2d(saved["shape"], sh["box"])[1]) for sh in saved["shards"]]
    loading_shards = [(sh, as_2d(loading["shape"], sh["box"])[1]) for sh in loading["shards"]]
    mine = [box for sh, box in loading_shards if sh["file"] == f"rank-{a.rank}.bin"]
    if len(mine) != 1:
        tool_errors.fail(f"rank {a.rank} holds no shard of '{a.tensor}' in {a.loading}")
    mine = mine[0]
    files = sorted({sh["file"] for sh, _ in saved_shards}, key=file_rank)
    color = {f: COLORS[i % len(COLORS)] for i, f in enumerate(files)}
    chunk = saved_index["chunk_bytes"]
    sizes = {f: (pathlib.Path(a.saved) / f).stat().st_size for f in files}

    # Geometry: two tensor panels of one scale, the file bars to their right.
    side = 200
    scale = side / max(rows, cols)
    tw, th = cols * scale, rows * scale
    top, left, gap = 100, 30, 110
    x1, x2 = left, left + tw + gap
    bars_x, bar_w = x2 + tw + gap, 420
    width = int(bars_x + bar_w + 70)
    read = [(sh, box, overlap(box, mine)) for sh, box in saved_shards]
    read = [(sh, box, part) for sh, box, part in read if part]
    step = 150  # a file's rows: its bar, its shard zoomed, the read
    height = int(max(top + th + 60, top + 10 + len(read) * step + 20))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<title>{escape(a.title)}</title>',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="24" font-size="14" font-weight="bold">{escape(a.title)}</text>']
    shape = "×".join(str(d) for d in saved["shape"])

    def rect(x0, y0, box, **attrs):
        (r, nr), (c, nc) = box
        extra = " ".join(f'{k.replace("_", "-")}="{v}"' for k, v in attrs.items())
        return (f'<rect x="{x0 + c * scale:.1f}" y="{y0 + r * scale:.1f}" '
                f'width="{nc * scale:.1f}" height="{nr * scale:.1f}" {extra}/>')

    def label(x0, y0, box, text, **attrs):
        (r, nr), (c, nc) = box
        extra = " ".join(f'{k.replace("_", "-")}="{v}"' for k, v in attrs.items())
        return (f'<text x="{x0 + (c + nc / 2) * scale:.1f}" y="{y0 + (r + nr / 2) * scale + 4:.1f}" '
                f'text-anchor="middle" {extra}>{escape(text)}</text>')

    def heading(x, number, head, lines):
        out.append(f'<text x="{x}" y="{top - 50}" font-weight="bold">{number}. {escape(head)}</text>')
        for k, line in enumerate(lines):
            out.append(f'<text x="{x}" y="{top - 32 + 15 * k}" fill="#555">{escape(line)}</text>')

    # Panel 1: the saved shards.
    heading(x1, 1, f"saved: {a.saved_label}", [f"{a.tensor} [{shape}]", "a box per shard file"])
    for sh, box in saved_shards:
        out.append(rect(x1, top, box, fill=color[sh["file"]], fill_opacity="0.75",
                        stroke="white", stroke_width="2"))
        out.append(label(x1, top, box, sh["file"].removesuffix(".bin"), fill="white",
                         font_weight="bold"))
    out.append(f'<rect x="{x1}" y="{top}" width="{tw:.1f}" height="{th:.1f}" fill="none" '
               'stroke="#333"/>')

    # Panel 2: the loading mesh's cut, the loading rank's box filled from the saved shards.
    heading(x2, 2, f"loading: {a.loaded_label}",
            [f"rank {a.rank}'s box (bold), coloured", "by the saved shards it overlaps"])
    out.append(f'<rect x="{x2}" y="{top}" width="{tw:.1f}" height="{th:.1f}" fill="#f4f4f4"/>')
    for sh, box, part in read:
        out.append(rect(x2, top, part, fill=color[sh["file"]], fill_opacity="0.75"))
    for sh, box in loading_shards:
        me = box == mine
        out.append(rect(x2, top, box, fill="none", stroke="black" if me else "#777",
                        stroke_width="2.5" if me else "1",
                        stroke_dasharray="none" if me else "4 3"))
    for sh, box in loading_shards:
        (r, nr), (c, nc) = box
        out.append(f'<text x="{x2 + (c + nc / 2) * scale:.1f}" y="{top + th + 16:.1f}" '
                   f'text-anchor="middle" font-size="11" '
                   f'font-weight="{"bold" if box == mine else "normal"}">'
                   f'{file_rank(sh["file"])}</text>')
    out.append(f'<text x="{x2 + tw / 2:.1f}" y="{top + th + 32:.1f}" text-anchor="middle" '
               f'font-size="11" fill="#555">the loading ranks\' boxes</text>')

    # Panel 3: each saved file's bytes, its shard of the tensor zoomed, and what the rank reads.
    heading(bars_x, 3, f"what rank {a.rank} reads of each saved file",
            [f"the file, with its {a.tensor} shard; below it the shard's bytes,",
             "the runs the rank needs dark, the range it reads bracketed"])
    for i, (sh, box, part) in enumerate(read):
        f = sh["file"]
        y = top + 10 + i * step
        size = sizes[f]
        px = bar_w / size
        offset = sh["offset"]
        nbytes = box[0][1] * box[1][1] * 4
        need = runs(box, part)
        first, last = need[0][0], need[-1][1]
        c0, c1 = first // chunk, (last - 1) // chunk
        begin, end = c0 * chunk, min((c1 + 1) * chunk, nbytes)
        # The file, the shard in it.
        out.append(f'<text x="{bars_x}" y="{y - 5}" font-weight="bold" fill="{color[f]}">'
                   f'{escape(f)}</text>')
        out.append(f'<text x="{bars_x + bar_w}" y="{y - 5}" text-anchor="end" fill="#555" '
                   f'font-size="11">{size} bytes</text>')
        out.append(f'<rect x="{bars_x}" y="{y}" width="{bar_w}" height="16" fill="#eee" '
                   'stroke="#999"/>')
        sx0, sx1 = bars_x + offset * px, bars_x + (offset + nbytes) * px
        out.append(f'<rect x="{sx0:.1f}" y="{y}" width="{sx1 - sx0:.1f}" height="16" '
                   f'fill="{color[f]}" fill-opacity="0.5"/>')
        # The shard zoomed to the bar's width: the needed runs dark.
        zy = y + 42
        zpx = bar_w / nbytes
        out.append(f'<path d="M{sx0:.1f},{y + 16} L{bars_x},{zy} M{sx1:.1f},{y + 16} '
                   f'L{bars_x + bar_w},{zy}" stroke="#aaa" fill="none"/>')
        out.append(f'<rect x="{bars_x}" y="{zy}" width="{bar_w}" height="22" fill="{color[f]}" '
                   'fill-opacity="0.2" stroke="#999"/>')
        for s0, e0 in need:
            out.append(f'<rect x="{bars_x + s0 * zpx:.2f}" y="{zy}" '
                       f'width="{max((e0 - s0) * zpx, 0.8):.2f}" height="22" fill="{color[f]}"/>')
        bx0, bx1 = bars_x + begin * zpx, bars_x + end * zpx
        out.append(f'<path d="M{bx0:.1f},{zy + 26} v6 H{bx1:.1f} v-6" fill="none" '
                   'stroke="black"/>')
        out.append(f'<text x="{bars_x}" y="{zy + 48}" fill="#333" font-size="11">'
                   f'needs {len(need)} run{"s" if len(need) != 1 else ""} of '
                   f'{need[0][1] - need[0][0]} bytes ({sum(e0 - s0 for s0, e0 in need)} of the '
                   f'shard\'s {nbytes}); reads file bytes {offset + begin}…{offset + end}</text>')
    y = top + 10 + len(read) * step - 12
    size_text = f"{chunk // 2**20} MiB" if chunk % 2**20 == 0 else f"{chunk} bytes"
    out.append(f'<text x="{bars_x}" y="{y}" fill="#555" font-size="11">a read is rounded out to '
               f'whole chunks of {size_text}, each checked by its CRC-32</text>')
    out.append('</svg>')
    pathlib.Path(a.out).write_text("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    tool_errors.run(main, "checkpoint_svg")
