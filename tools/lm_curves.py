#!/usr/bin/env python3
"""Trains the language model on every stage and in PyTorch, draws the loss curves, checks they agree.

Each stage runs on the CPU with the same model, init, data and optimizer (01 on 1 rank; 02-06 on
2 ranks; 07 --dp 2, 08 --cp 2, 09 --pp 2 on 2), every step's loss and the held-out loss every
--eval-every steps read from its --json. PyTorch trains the same model: a Llama written here in a
few lines of torch (the math of DESIGN.md "The block" and "The language model around the block"),
its initial weights read from stage 01's --dump at the same flags, the same batches (the stages'
window sampler, common/data.cc, re-implemented below over the same token file), and
torch.optim.AdamW with the same betas, eps and weight decay (on the matrices, the embedding and the
output layer; none on the norm gains). Then:

  - an SVG: the training loss of every stage and of PyTorch, the held-out loss, and each stage's
    relative difference from PyTorch step by step;
  - a markdown page: the command, the sizes, the time, and a table of the final losses with each
    stage's largest relative difference from PyTorch;
  - the check: every stage's curve within TIGHT of PyTorch's over the first --tight-steps steps
    and within LOOSE over all of them (see below); exit status 1 otherwise.

    tools/lm_curves.py --bin-dir build/bin [--data FILE|synthetic] [--steps N] [--eval-every K]
                       [--hidden H --heads NH --kv-heads NKV --ffn F --layers L --seq S
                        --batch B --lr LR] [--stages 01,02,...] [--svg OUT.svg] [--md OUT.md]
                       [--work DIR] [--mpirun "mpirun FLAGS"]

Needs numpy and torch (Debian's python3-torch; run it with /usr/bin/python3): exit status 77
(a skip for ctest) without them. Bad input: one line, exit status 2.
"""
import argparse
import json
import math
import os
import shlex
import shutil
import struct
import subprocess
import sys
import time
from xml.sax.saxutils import escape

import tool_errors
from tool_errors import fail

SKIP = 77

# fp32 everywhere, two programs summing in different orders: the first step's loss agrees to a
# few ulps of the sums (~1e-7 relative). AdamW divides each gradient element by its own running
# RMS, so an element whose gradient is tiny and noisy moves by a full lr whichever sign its
# rounding gave it: the two models drift apart a little every step, and the drift compounds over
# hundreds of steps. So the first steps are compared tightly (any real difference of the math,
# a transposed weight, a wrong RoPE pair or a missed weight decay, shows at once, far above
# 1e-4) and the whole curve loosely (a curve that learns differently, a different batch or a
# wrong learning rate, departs by far more than 2 % within a few dozen steps).
TIGHT = 1e-4
LOOSE = 2e-2

LAYER_PARAMS = ["norm1", "wq", "wk", "wv", "wo", "norm2", "w_gate", "w_up", "w_down"]
EPS = 1e-5
KVALID = 1 << 62
MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
ID_TOKENS, ID_WINDOWS = 6, 7  # common/init.h TensorId

# Each stage, its ranks and its own flags (a 2-rank mesh of the dimension it adds). Every stage
# runs fp32, stage 06 too: the curves are compared with fp32 PyTorch.
STAGES = {
    "01": ("01_baseline", 1, []),
    "02": ("02_megatron_tp", 2, []),
    "03": ("03_sequence_parallel", 2, []),
    "04": ("04_overlap_ring", 2, []),
    "05": ("05_copy_engine_async_tp", 2, []),
    "06": ("06_fp8", 2, ["--dtype", "fp32"]),  # its default is the FP8 recipe
    "07": ("07_fsdp_tp", 2, ["--dp", "2"]),
    "08": ("08_context_parallel", 2, ["--cp", "2"]),
    "09": ("09_pipeline_parallel", 2, ["--pp", "2"]),
}
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22"]
TORCH_COLOR = "#000000"


# --- the stages' token stream (common/init.cc bits_at, common/data.cc TokenStream::batch) -------

def mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def bits_at(seed, tid, index):
    return mix(mix(mix((seed + GOLDEN) & MASK) ^ ((tid * GOLDEN) & MASK)) ^ ((index + GOLDEN) & MASK))


def read_token_header(f, path):
    """(vocab, train ids, held-out ids) counts from a token file's header (common/token_file.h),
    read from the open file f."""
    head = f.read(64)
    if len(head) < 64 or head[:8] != b"TPXTOKN1":
        fail(f"token file '{path}': not a token file (no TPXTOKN1 header)")
    version, vocab, n_train, n_valid = struct.unpack("<IIQQ", head[8:32])
    if version != 1:
        fail(f"token file '{path}': version {version}, this tool reads 1")
    return vocab, n_train, n_valid


def read_token_file(path):
    """(vocab, train ids, held-out ids) of a token file (common/token_file.h)."""
    import numpy as np
    with open(path, "rb") as f:
        vocab, n_train, n_valid = read_token_header(f, path)
        ids = np.frombuffer(f.read(), dtype="<u2")
    if ids.size != n_train + n_valid:
        fail(f"token file '{path}': {ids.size} ids, its header says {n_train + n_valid}")
    return vocab, ids[:n_train].astype(np.int64), ids[n_train:].astype(np.int64)


class Stream:
    """Step t's batch: tokens and targets [S, B], as every stage draws them."""

    def __init__(self, data, vocab, seq, batch, seed):
        self.seq, self.batch, self.seed, self.vocab = seq, batch, seed, vocab
        self.splits = None
        if data != "synthetic":
            _, train, valid = read_token_file(data)
            self.splits = {"train": train, "valid": valid}

    def get(self, step, split="train"):
        import numpy as np
        S, B = self.seq, self.batch
        out = np.zeros((S + 1, B), dtype=np.int64)
        draws = KVALID if split == "valid" else 0
        for b in range(B):
            window = draws + step * B + b
            if self.splits is None:
                out[:, b] = [bits_at(self.seed, ID_TOKENS, window * (S + 1) + p) % self.vocab
                             for p in range(S + 1)]
            else:
                ids = self.splits[split]
                start = bits_at(self.seed, ID_WINDOWS, window) % (ids.size - S)
                out[:, b] = ids[start:start + S + 1]
        return out[:-1], out[1:]


# --- the model in torch (DESIGN.md "The block"), weights [in, out] as the dump holds them -------

def rms_norm(torch, x, g):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g


def rope(torch, x, theta):
    """x [S, B, heads, D]: pair (i, i + D/2) rotated by p · theta^(-2i/D) at position p."""
    if theta == 0:
        return x
    S, D = x.shape[0], x.shape[-1]
    inv = theta ** (-torch.arange(0, D // 2, dtype=torch.float64) * 2 / D)
    ang = torch.arange(S, dtype=torch.float64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None, None, :]
    half = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos + half * sin


def forward_loss(torch, a, P, tokens, targets):
    S, B = tokens.shape
    D = a.hidden // a.heads
    x = P["embedding"][tokens]  # [S, B, H]
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    for l in range(a.layers):
        w = {p: P[f"layers.{l}.{p}"] for p in LAYER_PARAMS}
        h = rms_norm(torch, x, w["norm1"])
        q = rope(torch, (h @ w["wq"]).view(S, B, a.heads, D), a.rope_theta)
        k = rope(torch, (h @ w["wk"]).view(S, B, a.kv_heads, D), a.rope_theta)
        v = (h @ w["wv"]).view(S, B, a.kv_heads, D)
        rep = a.heads // a.kv_heads  # query head h reads KV head h / rep
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        score = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(D)
        score = score.masked_fill(~mask, float("-inf")).softmax(-1)
        att = torch.einsum("bhst,tbhd->sbhd", score, v).reshape(S, B, a.hidden)
        x = x + att @ w["wo"]
        h2 = rms_norm(torch, x, w["norm2"])
        x = x + (torch.nn.functional.silu(h2 @ w["w_gate"]) * (h2 @ w["w_up"])) @ w["w_down"]
    logits = rms_norm(torch, x, P["norm_f"]) @ P["w_out"]  # [S, B, V]
    return torch.nn.functional.cross_entropy(logits.reshape(S * B, -1), targets.reshape(-1))


def train_torch(a, dump, stream):
    """PyTorch's curve: [(step, loss, held-out loss or None)], from the dump's initial weights."""
    import numpy as np
    import torch
    torch.set_num_threads(1)
    names = ["embedding", "norm_f", "w_out"] + [
        f"layers.{l}.{p}" for l in range(a.layers) for p in LAYER_PARAMS]
    P = {n: torch.nn.Parameter(torch.from_numpy(np.load(os.path.join(dump, n + ".npy"))).float())
         for n in names}
    gains = [P[n] for n in names if n == "norm_f" or n.endswith(("norm1", "norm2"))]
    rest = [P[n] for n in names if all(P[n] is not g for g in gains)]
    opt = torch.optim.AdamW([{"params": rest, "weight_decay": a.weight_decay},
                             {"params": gains, "weight_decay": 0.0}],
                            lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
    rows = []
    for step in range(a.steps):
        tokens, targets = (torch.from_numpy(t) for t in stream.get(step))
        loss = forward_loss(torch, a, P, tokens, targets)
        opt.zero_grad()
        loss.backward()
        held = None
        if a.eval_every > 0 and (step % a.eval_every == 0 or step == a.steps - 1):
            with torch.no_grad():
                vt, vg = (torch.from_numpy(t) for t in stream.get(step, "valid"))
                held = float(forward_loss(torch, a, P, vt, vg))
        opt.step()
        rows.append((step, float(loss), held))
    return rows


# --- the stages ---------------------------------------------------------------------------------

def stage_flags(a):
    f = ["--task", "lm", "--data", a.data, "--hidden", a.hidden, "--heads", a.heads,
         "--kv-heads", a.kv_heads, "--ffn", a.ffn, "--layers", a.layers, "--seq", a.seq,
         "--batch", a.batch, "--steps", a.steps, "--seed", a.seed, "--rope-theta", repr(a.rope_theta),
         "--optimizer", "adamw", "--lr", repr(a.lr), "--beta1", repr(a.beta1),
         "--beta2", repr(a.beta2), "--eps", repr(a.eps), "--weight-decay", repr(a.weight_decay),
         "--eval-every", a.eval_every]
    if a.data == "synthetic":
        f += ["--vocab", a.vocab]
    return [str(x) for x in f]


def run_stage(a, key, extra, tag=None, own=None):
    """Stage `key` on its ranks with its own flags (or `own`) and `extra`: its rows and seconds.
    Its --json goes to <work>/<tag or key>.json."""
    exe, ranks, stage_own = STAGES[key]
    own = stage_own if own is None else own
    path = os.path.join(a.bin_dir, exe)
    if not os.path.isfile(path):
        fail(f"--bin-dir: no executable '{path}' (build the stages first)")
    out = os.path.join(a.work, f"{tag or key}.json")
    cmd = shlex.split(a.mpirun) + ["-np", str(ranks), path] + own + stage_flags(a) + \
        ["--json", out] + extra
    secs = run_timed(cmd, exe)
    steps = json.load(open(out))["steps"]
    rows = [(s["step"], s["loss"], s.get("eval_loss")) for s in steps]
    print(f"  {exe}: {len(rows)} steps in {secs:.0f} s, final loss {rows[-1][1]:.4f}", flush=True)
    return rows, secs


def rel_diffs(rows, ref):
    return [abs(r[1] - q[1]) / abs(q[1]) for r, q in zip(rows, ref)]


def held_diffs(rows, ref):
    return [abs(r[2] - q[2]) / abs(q[2]) for r, q in zip(rows, ref)
            if r[2] is not None and q[2] is not None]


# --- the figure -----------------------------------------------------------------------------------

# The panels' left margin and width; the legend to their right is as wide as its longest name:
# a sample line, then the name at LEGEND_CHAR pixels a character (a generous average for a 12 px
# sans-serif, so that the longest stage name, 05_copy_engine_async_tp, is not cut by the edge).
LEFT, PLOT = 70, 520
LEGEND_LINE, LEGEND_CHAR, LEGEND_PAD = 40, 7.5, 12


def legend_width(names):
    return LEGEND_LINE + math.ceil(LEGEND_CHAR * max(len(n) for n in names)) + LEGEND_PAD


def panel(out, top, height, steps, lo, hi, series, ylabel, fmt, log=False):
    """series: (label, color, [(step, value)], dashed, width)."""
    tr = (lambda v: math.log10(v)) if log else (lambda v: v)
    x = lambda i: LEFT + PLOT * i / max(steps - 1, 1)
    y = lambda v: top + height - height * (tr(v) - tr(lo)) / ((tr(hi) - tr(lo)) or 1)
    out.append(f'<rect x="{LEFT}" y="{top}" width="{PLOT}" height="{height}" '
               'fill="none" stroke="#999"/>')
    if log:
        marks = [10.0 ** e for e in range(math.floor(tr(lo)), math.ceil(tr(hi)) + 1)
                 if lo <= 10.0 ** e <= hi]
    else:
        marks = [lo + (hi - lo) * i / 4 for i in range(5)]
    for v in marks:
        out.append(f'<line x1="{LEFT - 4}" x2="{LEFT + PLOT}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                   'stroke="#eee"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{fmt(v)}</text>')
    out.append(f'<text x="16" y="{top + height / 2}" transform="rotate(-90 16 {top + height / 2})" '
               f'text-anchor="middle">{escape(ylabel)}</text>')
    for label, color, pts, dashed, width in series:
        pts = [(i, min(max(v, lo), hi)) for i, v in pts if v is not None]
        if not pts:
            continue
        p = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in pts)
        dash = ' stroke-dasharray="6 3"' if dashed else ""
        out.append(f'<polyline points="{p}" fill="none" stroke="{color}" stroke-width="{width}"'
                   f'{dash}/>')
    for i in range(5):
        s = round((steps - 1) * i / 4)
        out.append(f'<text x="{x(s):.1f}" y="{top + height + 15}" text-anchor="middle">{s}</text>')


def draw(a, curves, ref, path):
    steps = len(ref)
    top1, h1, top2, h2, top3, h3 = 70, 250, 370, 160, 580, 130
    height = top3 + h3 + 50
    title = (f"Language model on the King James Version: every stage and PyTorch"
             if a.data != "synthetic" else "Language model on a synthetic stream: stages and PyTorch")
    sub = (f"H {a.hidden}, NH {a.heads}, NKV {a.kv_heads}, F {a.ffn}, L {a.layers}, V {a.vocab}, "
           f"S {a.seq}, B {a.batch} | AdamW lr {a.lr:g}, wd {a.weight_decay:g} | {steps} steps | "
           f"device cpu, fp32")
    names = [STAGES[k][0] for k in curves] + ["PyTorch"]
    W = LEFT + PLOT + legend_width(names)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" '
           'font-family="sans-serif" font-size="12">',
           f'<title>{escape(title)}</title>',
           f'<rect width="{W}" height="{height}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
           f'<text x="{W / 2}" y="42" text-anchor="middle" fill="#444">{escape(sub)}</text>']
    keys = list(curves)
    everything = [r[1] for r in ref] + [r[1] for k in keys for r in curves[k]]
    held = [r[2] for r in ref if r[2] is not None]
    lo, hi = min(everything + held), max(everything + held)
    pad = 0.03 * (hi - lo)
    series = [(f"{k}", COLORS[i % len(COLORS)], [(r[0], r[1]) for r in curves[k]], False, 1.2)
              for i, k in enumerate(keys)]
    series.append(("PyTorch", TORCH_COLOR, [(r[0], r[1]) for r in ref], True, 1.6))
    out.append(f'<text x="{LEFT}" y="{top1 - 8}">training loss (each step\'s batch, before its '
               'update)</text>')
    panel(out, top1, h1, steps, lo - pad, hi + pad, series, "loss", lambda v: f"{v:.2f}")
    hseries = [(k, COLORS[i % len(COLORS)], [(r[0], r[2]) for r in curves[k]], False, 1.2)
               for i, k in enumerate(keys)]
    hseries.append(("PyTorch", TORCH_COLOR, [(r[0], r[2]) for r in ref], True, 1.6))
    hv = [v for _, _, pts, _, _ in hseries for _, v in pts if v is not None]
    hpad = 0.03 * (max(hv) - min(hv)) if hv else 0
    out.append(f'<text x="{LEFT}" y="{top2 - 8}">held-out loss (every {a.eval_every} steps and '
               'the last)</text>')
    panel(out, top2, h2, steps, min(hv) - hpad, max(hv) + hpad, hseries, "held-out",
          lambda v: f"{v:.2f}")
    dseries = [(k, COLORS[i % len(COLORS)],
                [(r[0], max(d, 1e-9)) for r, d in zip(curves[k], rel_diffs(curves[k], ref))],
                False, 1.0) for i, k in enumerate(keys)]
    out.append(f'<text x="{LEFT}" y="{top3 - 8}">|stage − PyTorch| / PyTorch, training loss '
               f'(log; check: ≤ {TIGHT:g} for steps &lt; {a.tight_steps}, ≤ {LOOSE:g} for all)'
               '</text>')
    panel(out, top3, h3, steps, 1e-9, 1e-1, dseries, "rel. diff.", lambda v: f"{v:.0e}", log=True)
    out.append(f'<text x="{LEFT + PLOT / 2}" y="{height - 12}" text-anchor="middle">'
               'AdamW step</text>')
    for k, (label, color, _, dashed, width) in enumerate(series):
        yy = top1 + 14 + 18 * k
        name = label if label == "PyTorch" else STAGES[label][0]
        dash = ' stroke-dasharray="6 3"' if dashed else ""
        out.append(f'<line x1="{LEFT + PLOT + 10}" x2="{LEFT + PLOT + 36}" y1="{yy}" y2="{yy}" '
                   f'stroke="{color}" stroke-width="{width + 0.8}"{dash}/>')
        out.append(f'<text x="{LEFT + PLOT + LEGEND_LINE}" y="{yy + 4}">{escape(name)}</text>')
    out.append("</svg>")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(out) + "\n")
    os.replace(tmp, path)


# --- the page ---------------------------------------------------------------------------------

def write_md(a, curves, ref, secs, total, command, path):
    rel_svg = os.path.relpath(os.path.abspath(a.svg), os.path.dirname(os.path.abspath(path)))
    last = ref[-1]
    lines = [
        "# The language model learns: loss curves of every stage and PyTorch",
        "",
        "Every stage trains the same language model (same sizes, initial weights, batches and "
        "AdamW) on the King James Version, on the CPU; PyTorch trains it too, from stage 01's "
        "`--dump` of the initial weights, with the stages' window sampler re-implemented in "
        "Python over the same token file and `torch.optim.AdamW` (weight decay on the matrices, "
        "the embedding and the output layer; none on the norm gains). The figure and this page "
        "are written by one command:" if a.data != "synthetic" else
        "Every stage and PyTorch train the same language model on a synthetic stream.",
        "",
        "```sh",
        command,
        "```",
        "",
        f"{sizes_text(a)}. Device: cpu (fp32). The whole command took {total / 60:.1f} minutes "
        "on a 2-core machine (stage runs and PyTorch: below).",
        "",
        f"![Training and held-out loss of every stage and PyTorch]({rel_svg})",
        "",
        "| run | ranks | final loss | final held-out loss | max rel. diff. from PyTorch, "
        f"steps < {a.tight_steps} | max rel. diff., all steps | max rel. diff., held-out | "
        "time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, rows in curves.items():
        exe, ranks, own = STAGES[k]
        d = rel_diffs(rows, ref)
        h = held_diffs(rows, ref)
        held = f"{rows[-1][2]:.4f}" if rows[-1][2] is not None else "—"
        label = f"{exe} {' '.join(own)}".strip()
        lines.append(f"| `{label}` | {ranks} | {rows[-1][1]:.4f} | {held} | "
                     f"{max(d[:a.tight_steps]):.1e} | {max(d):.1e} | "
                     f"{(f'{max(h):.1e}' if h else '—')} | {secs[k]:.0f} |")
    lines.append(f"| PyTorch {sys.modules['torch'].__version__} | 1 | {last[1]:.4f} | "
                 f"{last[2]:.4f} | — | — | — | {secs['torch']:.0f} |")
    no_held = [STAGES[k][0] for k, rows in curves.items() if all(r[2] is None for r in rows)]
    lines += [
        "",
        f"The check (the tool exits 1 otherwise): every stage's training loss within {TIGHT:g} "
        f"of PyTorch's, relative, for the first {a.tight_steps} steps, and within {LOOSE:g} for "
        "all of them. Both programs compute in fp32 but sum in different orders, so the first "
        "step agrees to about 1e-7. AdamW then divides every gradient element by its own running "
        "RMS: an element whose gradient is tiny and noisy moves by a whole learning rate whichever "
        "sign its rounding gave it, so the two models drift apart a little every step and the "
        "drift compounds. A real difference of the math (a transposed weight, a RoPE pair, a "
        "missed weight decay, another batch) shows at the first steps far above the tight bound.",
    ]
    if no_held:
        lines += ["", f"{', '.join(no_held)} reports no held-out loss (`eval_loss`), so its "
                  "held-out curve is absent."]
    lines.append("")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines))
    os.replace(tmp, path)


def run_timed(cmd, name):
    """Runs cmd (printed first), its output kept; stops with the output's tail and one line
    when it fails. Returns the seconds it took."""
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    t0 = time.monotonic()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    secs = time.monotonic() - t0
    if r.returncode != 0:
        print(r.stdout[-4000:])
        fail(f"{name} exited {r.returncode}")
    return secs


def sizes_text(a):
    """The run's sizes and AdamW settings, as the pages state them (no full stop)."""
    return (f"Sizes: H {a.hidden}, NH {a.heads}, NKV {a.kv_heads}, F {a.ffn}, L {a.layers}, "
            f"V {a.vocab}, S {a.seq}, B {a.batch}; {a.steps} AdamW steps (lr {a.lr:g}, betas "
            f"{a.beta1:g}/{a.beta2:g}, eps {a.eps:g}, weight decay {a.weight_decay:g}), seed "
            f"{a.seed}, held-out loss every {a.eval_every} steps and at the last")


def add_model_flags(ap, **sizes):
    """The language model's sizes (their defaults `sizes`, by flag name with _ for -) and its
    AdamW run's flags, as the stages spell them: the runs' flags (stage_flags) read these."""
    for name in ("hidden", "heads", "kv_heads", "ffn", "layers", "seq", "batch", "steps",
                 "eval_every"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=sizes[name])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--seed", type=int, default=1234)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", required=True, help="where the stage executables are")
    ap.add_argument("--data", help="a token file, or synthetic (default: the build's corpus, "
                    "<bin-dir>/../data/kjv-4096.tokens)")
    ap.add_argument("--vocab", type=int, default=256, help="--data synthetic's vocabulary")
    add_model_flags(ap, hidden=128, heads=4, kv_heads=2, ffn=384, layers=2, seq=64, batch=8,
                    steps=300, eval_every=25)
    ap.add_argument("--tight-steps", type=int, default=10,
                    help=f"the first steps compared within {TIGHT:g}")
    ap.add_argument("--stages", default=",".join(STAGES), help="which, e.g. 01,02")
    ap.add_argument("--svg", default="docs/figures/lm_loss_curves.svg")
    ap.add_argument("--md", default="docs/lm-curves.md")
    ap.add_argument("--work", default="build/lm_curves", help="a directory for the runs (replaced)")
    ap.add_argument("--mpirun", default="mpirun --oversubscribe --bind-to none",
                    help="launcher and its flags (-np N is added)")
    a = ap.parse_args()
    t_start = time.monotonic()
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        print(f"SKIPPED: {e} (Debian: apt-get install python3-torch; run with /usr/bin/python3)")
        return SKIP
    keys = [k.strip() for k in a.stages.split(",") if k.strip()]
    for k in keys:
        if k not in STAGES:
            fail(f"--stages: '{k}' is not a stage (01 … 09)")
    if "01" not in keys:
        fail("--stages: 01 is needed (its --dump gives PyTorch the initial weights)")
    for name in ("steps", "eval_every", "tight_steps"):
        if getattr(a, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(a, name)})")
    if a.data is None:
        a.data = os.path.normpath(os.path.join(a.bin_dir, "..", "data", "kjv-4096.tokens"))
    if a.data != "synthetic":
        if not os.path.isfile(a.data):
            fail(f"--data: no token file '{a.data}' (the build makes it where Debian's bible-kjv "
                 "is installed; or --data synthetic)")
        a.vocab = read_token_file(a.data)[0]
    if os.path.exists(a.work):
        shutil.rmtree(a.work)
    os.makedirs(a.work)

    command = "tools/lm_curves.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    curves, secs = {}, {}
    dump = os.path.join(a.work, "dump01")
    for k in keys:
        curves[k], secs[k] = run_stage(a, k, ["--dump", dump] if k == "01" else [])
    stream = Stream(a.data, a.vocab, a.seq, a.batch, a.seed)
    t0 = time.monotonic()
    ref = train_torch(a, dump, stream)
    secs["torch"] = time.monotonic() - t0
    print(f"  PyTorch: {len(ref)} steps in {secs['torch']:.0f} s, final loss {ref[-1][1]:.4f}")
    bad = []
    for k, rows in curves.items():
        if len(rows) != len(ref):
            bad.append(f"{STAGES[k][0]}: {len(rows)} steps, PyTorch ran {len(ref)}")
            continue
        d = rel_diffs(rows, ref)
        h = held_diffs(rows, ref)
        tight, loose = max(d[:a.tight_steps]), max(d + h)
        print(f"{STAGES[k][0]:<24} final {rows[-1][1]:.4f}  max rel. diff. from PyTorch: "
              f"first {a.tight_steps} steps {tight:.2e}, all {max(d):.2e}, held-out "
              f"{(f'{max(h):.2e}' if h else '-')}")
        if tight > TIGHT:
            bad.append(f"{STAGES[k][0]}: {tight:.2e} > {TIGHT:g} in the first {a.tight_steps} steps")
        if loose > LOOSE:
            bad.append(f"{STAGES[k][0]}: {loose:.2e} > {LOOSE:g} over the run")
    draw(a, curves, ref, a.svg)
    write_md(a, curves, ref, secs, time.monotonic() - t_start, command, a.md)
    print(f"wrote {a.svg} and {a.md} ({(time.monotonic() - t_start) / 60:.1f} min)")
    for b in bad:
        print(f"lm_curves: MISMATCH {b}")
    print("FAIL" if bad else "PASS")
    return 1 if bad else 0


if __name__ == "__main__":
    tool_errors.run(main, "lm_curves")
