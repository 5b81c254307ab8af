#!/usr/bin/env python3
"""Draws the vocabulary-parallel cross-entropy of chapter 2 as SVG: the logits [S·B, V] cut over
the vocabulary across T ranks, and the three per-row all-reduces that give the loss.

Each rank's block of V_pad/T columns is drawn in its colour; the columns past V (the padding that
makes V_pad a multiple of T, as Megatron pads it) are hatched grey and masked out of the softmax.
In every row one cell is outlined: the row's target, held by exactly one rank. Beside each rank's
block are its three numbers per row (local max, Σ exp, target logit or 0); on the right, the three
all-reduces over the TP group that combine them, and the loss of the row.

Usage: tools/vocab_svg.py [--ranks T] [--vocab V] -o OUT.svg
       tools/vocab_svg.py --check      # exit 1 if docs/figures/02_vocab_parallel_ce_np4.svg is
                                       # not what it would write (tools/sharding_svg.py --all
                                       # writes and checks it with the other figures)
Only the standard library.
"""
import argparse
import pathlib
import sys
from xml.sax.saxutils import escape

import tool_errors

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIGURE = ROOT / "docs" / "figures" / "02_vocab_parallel_ce_np4.svg"
COLORS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2"]
ROWS = 5  # positions drawn (of S·B)


def targets(vocab, rows):
    """A fixed, spread-out target id for each drawn row (every rank gets some)."""
    return [(3 + 5 * i) % vocab for i in range(rows)]


def figure(t=4, vocab=14):
    local = -(-vocab // t)  # ceil: V_pad / T
    padded = local * t
    cell, gap_rank, left, top = 26, 18, 110, 96
    block_w = local * cell
    grid_w = t * block_w + (t - 1) * gap_rank
    right = left + grid_w + 40
    red_w = 330
    width = right + red_w
    height = top + ROWS * cell + 120
    tgt = targets(vocab, ROWS)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           'font-family="sans-serif" font-size="11">',
           '<defs><pattern id="pad" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" fill="white"/>'
           '<line x1="0" y1="0" x2="0" y2="6" stroke="#aaa" stroke-width="3"/></pattern>'
           '<marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
           'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker>'
           '</defs>',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="10" y="20" font-size="14" font-weight="bold">vocabulary-parallel '
           f'cross-entropy: logits [S·B, V] cut over V across T = {t} ranks</text>',
           f'<text x="10" y="38" fill="#555">V = {vocab} ids padded to V_pad = {padded} '
           f'(a multiple of T): each rank holds {local} contiguous ids, [S·B, V_pad/T] logits; '
           'no rank ever holds a whole row</text>']
    for r in range(t):
        x = left + r * (block_w + gap_rank)
        lo, hi = r * local, r * local + local - 1
        out.append(f'<text x="{x + block_w / 2}" y="{top - 30}" text-anchor="middle" '
                   f'font-weight="bold" fill="{COLORS[r]}">rank {r}</text>')
        out.append(f'<text x="{x + block_w / 2}" y="{top - 14}" text-anchor="middle" '
                   f'fill="#555">ids {lo} … {hi}</text>')
        for c in range(local):
            v = r * local + c
            for i in range(ROWS):
                y = top + i * cell
                cx = x + c * cell
                if v >= vocab:
                    out.append(f'<rect x="{cx}" y="{y}" width="{cell}" height="{cell}" '
                               'fill="url(#pad)" stroke="#ccc"/>')
                else:
                    out.append(f'<rect x="{cx}" y="{y}" width="{cell}" height="{cell}" '
                               f'fill="{COLORS[r]}" fill-opacity="0.55" stroke="white"/>')
        for i in range(ROWS):
            if r * local <= tgt[i] < (r + 1) * local:
                cx = x + (tgt[i] - r * local) * cell
                y = top + i * cell
                out.append(f'<rect x="{cx + 1}" y="{y + 1}" width="{cell - 2}" '
                           f'height="{cell - 2}" fill="none" stroke="black" stroke-width="2.5"/>')
        if padded > vocab and r == t - 1:
            px = x + (vocab - r * local) * cell
            out.append(f'<text x="{px + (padded - vocab) * cell / 2}" y="{top + ROWS * cell + 14}"'
                       ' text-anchor="middle" fill="#777">pad</text>')
        # The rank's three numbers per row, under its block.
        sy = top + ROWS * cell + 34
        for j, label in enumerate(["m_r = max", "Σ_r = Σ e^(z−m_r)", "z_t or 0"]):
            out.append(f'<text x="{x + block_w / 2}" y="{sy + 14 * j}" text-anchor="middle" '
                       f'font-size="10" fill="{COLORS[r]}">{escape(label)}</text>')
    for i in range(ROWS):
        y = top + i * cell
        out.append(f'<text x="{left - 8}" y="{y + 17}" text-anchor="end" fill="#555">'
                   f'row {i}: t = {tgt[i]}</text>')
    out.append(f'<text x="10" y="{top + ROWS * cell + 14}" fill="#555">S·B rows …</text>')
    # The three all-reduces, one float per row each.
    steps = [("1. all-reduce MAX of m_r", "m = max_r m_r"),
             ("2. all-reduce SUM of Σ_r · e^(m_r − m)", "Σ = Σ_v e^(z_v − m)"),
             ("3. all-reduce SUM of the target logit", "z_t (one rank holds it, the rest add 0)")]
    ay = top - 6
    for j, (what, gives) in enumerate(steps):
        y = ay + 34 * j
        out.append(f'<line x1="{left + grid_w + 6}" y1="{y + 10}" x2="{right - 4}" y2="{y + 10}" '
                   'stroke="#555" stroke-width="1.5" marker-end="url(#arrow)"/>')
        out.append(f'<text x="{right + 2}" y="{y + 8}" font-weight="bold">{escape(what)}</text>')
        out.append(f'<text x="{right + 2}" y="{y + 22}" fill="#555">{escape(gives)}</text>')
    ly = ay + 34 * 3 + 8
    out.append(f'<text x="{right + 2}" y="{ly}" font-weight="bold">loss of the row = '
               'log Σ + m − z_t</text>')
    out.append(f'<text x="{right + 2}" y="{ly + 16}" fill="#555">each all-reduce: S·B floats, '
               '4·S·B bytes</text>')
    out.append(f'<text x="{right + 2}" y="{ly + 30}" fill="#555">gathering the logits would move '
               'S·B·V_pad·e</text>')
    notes = ["backward, on each rank's own columns: dz_v = (e^(z_v − m) / Σ − [v = t]) / (S·B), "
             "0 on the pad; no communication",
             "outlined: the row's target id; hatched: padding ids ≥ V, left out of max and Σ "
             "(their weights are zero and stay zero)"]
    for k, note in enumerate(notes):
        out.append(f'<text x="10" y="{height - 30 + 16 * k}" fill="#555">{escape(note)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="T (1 … 4)")
    ap.add_argument("--vocab", type=int, default=14, help="V (T … 40)")
    ap.add_argument("-o", "--out")
    ap.add_argument("--check", action="store_true",
                    help=f"compare {FIGURE.relative_to(ROOT)} with what it would write")
    a = ap.parse_args()
    if not 1 <= a.ranks <= len(COLORS):
        ap.error(f"--ranks must be 1 … {len(COLORS)}")
    if not a.ranks <= a.vocab <= 40:
        ap.error("--vocab must be at least --ranks and at most 40 (one cell per id)")
    if a.check:
        if not FIGURE.exists() or FIGURE.read_text() != figure():
            print(f"{FIGURE.relative_to(ROOT)}: stale; regenerate with tools/vocab_svg.py "
                  f"-o {FIGURE.relative_to(ROOT)}", file=sys.stderr)
            return 1
        return 0
    if not a.out:
        ap.error("give -o OUT.svg, or --check")
    pathlib.Path(a.out).write_text(figure(a.ranks, a.vocab))
    return 0


if __name__ == "__main__":
    tool_errors.run(main, "vocab_svg")
