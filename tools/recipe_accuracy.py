#!/usr/bin/env python3
"""What each low-precision recipe costs in accuracy: its GEMM error against fp64 on the language
model's real operands, and the language model's loss curves under it beside bf16's and fp32's.

One command, on the cpu:

  1. recipe_gemm_error (tools/recipe_gemm_error.cc) trains the language model in fp32 for --steps
     steps on one rank and, at the last step, quantizes both operands of every linear layer's
     three GEMMs (forward x·W, dgrad dy·Wᵀ, wgrad xᵀ·dy) as stage 06 does under each recipe,
     multiplies the dequantized operands in double and compares with the product of the
     unquantized operands in double;
  2. stage 06 trains the same model at --np ranks once per recipe (--dtype fp8 --fp8-recipe R),
     and under --dtype bf16 and --dtype fp32, each with the held-out loss every --eval-every
     steps (tools/lm_curves.py's runner and sizes' flags);
  3. an SVG (training loss, held-out loss, and each run's training loss less bf16's), a markdown
     page (the command, sizes, device, time, both tables), and the tables again between the
     markers <!-- recipe-accuracy:begin --> and <!-- recipe-accuracy:end --> of --chapter where
     it has them.

    tools/recipe_accuracy.py --bin-dir build-cpu/bin [--work DIR] [--recipes tensorwise,...]
                             [--steps N] [--eval-every K] [--hidden H ...] [--np N]
                             [--svg OUT.svg] [--md OUT.md] [--chapter README.md]

Bad input (a missing executable or token file, a recipe no stage runs, sizes that do not split):
one line, exit status 2. Needs only Python's standard library.
"""
import argparse
import json
import math
import os
import shlex
import shutil
import sys
import time
from xml.sax.saxutils import escape

import lm_curves
import tool_errors
from lm_curves import LEFT, PLOT, LEGEND_LINE, panel, legend_width
from tool_errors import fail

# The recipes stage 06 runs, in the order every table and legend lists them: the one place that
# names them.
RECIPES = ["tensorwise", "rowwise", "block128", "mxfp8", "nvfp4"]
# The high-precision runs beside them: bf16 is what the recipes are measured against.
BASELINES = ["bf16", "fp32"]
KINDS = ["forward", "dgrad", "wgrad"]
KIND_WORDS = {"forward": "forward x·W", "dgrad": "dgrad dy·Wᵀ", "wgrad": "wgrad xᵀ·dy"}
# Each run's colour in the figure.
COLORS = {"tensorwise": "#1f77b4", "rowwise": "#ff7f0e", "block128": "#2ca02c",
          "mxfp8": "#d62728", "nvfp4": "#9467bd", "bf16": "#000000", "fp32": "#7f7f7f"}
MARK_BEGIN, MARK_END = "<!-- recipe-accuracy:begin -->", "<!-- recipe-accuracy:end -->"
LAST = 10  # the training loss is also averaged over the last LAST steps (one batch is noisy)


def parse_recipes(words):
    out = [w.strip() for w in words.split(",") if w.strip()]
    if not out:
        fail("--recipes: name at least one recipe")
    for w in out:
        if w not in RECIPES:
            fail(f"--recipes: '{w}' is not a recipe stage 06 runs ({', '.join(RECIPES)})")
    return out


def check_sizes(a):
    """The shapes stage 06 refuses under a block recipe at --np ranks, refused here first (its
    rule, 06_fp8/layers.h: a block never straddles two ranks' shards)."""
    d = a.hidden // a.heads
    blocks = {"block128": 128, "mxfp8": 32, "nvfp4": 16}
    for r in a.recipe_list:
        b = blocks.get(r)
        if b is None or a.np == 1:
            continue
        for what, n in (("--hidden", a.hidden), ("--kv-heads × head dim", a.kv_heads * d),
                        ("--ffn", a.ffn)):
            if n % (a.np * b) != 0:
                fail(f"--recipes {r}: at --np {a.np} {what} = {n} splits into shards that are not "
                     f"a multiple of {b} (stage 06's rule: a block never straddles two shards)")


# --- the runs -----------------------------------------------------------------------------------

def gemm_errors(a):
    """recipe_gemm_error's JSON after --steps fp32 steps on one rank, and its seconds."""
    exe = os.path.join(a.bin_dir, "recipe_gemm_error")
    if not os.path.isfile(exe):
        fail(f"--bin-dir: no executable '{exe}' (build the target recipe_gemm_error)")
    out = os.path.join(a.work, "gemm_errors.json")
    flags = lm_curves.stage_flags(argparse.Namespace(**{**vars(a), "eval_every": 0}))
    cmd = [exe] + flags + ["--dtype", "fp32", "--recipes", ",".join(a.recipe_list),
                           "--emulate-ranks", str(a.np), "--gemm-errors", out]
    secs = lm_curves.run_timed(cmd, "recipe_gemm_error")
    print(f"  recipe_gemm_error: {secs:.0f} s", flush=True)
    return json.load(open(out)), secs


def run_label(run):
    return f"fp8 {run}" if run in RECIPES else run


def train_runs(a):
    """{run: rows}, {run: seconds}: stage 06 once per recipe, then bf16 and fp32."""
    exe, _, _ = lm_curves.STAGES["06"]
    lm_curves.STAGES["06"] = (exe, a.np, [])
    curves, secs = {}, {}
    for run in a.recipe_list + BASELINES:
        own = (["--dtype", "fp8", "--fp8-recipe", run] if run in RECIPES else ["--dtype", run])
        curves[run], secs[run] = lm_curves.run_stage(a, "06", [], tag=run, own=own)
    return curves, secs


# --- the numbers --------------------------------------------------------------------------------

def pooled(gemms, recipe, kind):
    """Over the seven linear layers of every block: sqrt(Σ‖C − C*‖² / Σ‖C*‖²), the largest
    relative Frobenius error, and the largest max-element error."""
    rows = [g for g in gemms if g["recipe"] == recipe and g["kind"] == kind]
    if not rows:
        fail(f"the GEMM errors hold no {kind} GEMM under {recipe}")
    num = sum((g["rel_frobenius"] * g["frobenius"]) ** 2 for g in rows)
    den = sum(g["frobenius"] ** 2 for g in rows)
    return (math.sqrt(num / den) if den > 0 else 0.0, max(g["rel_frobenius"] for g in rows),
            max(g["max_rel"] for g in rows), len(rows))


def elements(gemms, recipe):
    """'E4M3 × E4M3 / E5M2 × E4M3 / E4M3 × E5M2': each kind's operand formats."""
    out = []
    for kind in KINDS:
        g = next(g for g in gemms if g["recipe"] == recipe and g["kind"] == kind)
        out.append(f"{g['a']['element'].upper()}×{g['b']['element'].upper()}")
    return " / ".join(out)


def summary(rows):
    """(final loss, mean of the last LAST, final held-out loss)."""
    last = [r[1] for r in rows[-LAST:]]
    held = [r[2] for r in rows if r[2] is not None]
    return rows[-1][1], sum(last) / len(last), held[-1] if held else None


def gemm_table(errors):
    g = errors["gemms"]
    head = "| recipe | elements (fwd / dgrad / wgrad) | " + " | ".join(
        f"{KIND_WORDS[k]}: rel. Frobenius, all layers (worst layer) | {k}: max elem. error"
        for k in KINDS) + " |"
    lines = [head, "|---|---|" + "---|---|" * len(KINDS)]
    for r in errors["recipes"]:
        cells = []
        for k in KINDS:
            pool, worst, mx, _ = pooled(g, r, k)
            cells += [f"{pool:.2e} ({worst:.2e})", f"{mx:.2e}"]
        lines.append(f"| `{r}` | {elements(g, r)} | " + " | ".join(cells) + " |")
    return lines


def loss_table(curves, secs):
    base = summary(curves["bf16"])
    lines = [f"| run | final loss | mean loss, last {LAST} steps | gap to bf16 (last {LAST}) | "
             "final held-out loss | gap to bf16 (held-out) | time (s) |",
             "|---|---|---|---|---|---|---|"]
    for run, rows in curves.items():
        final, mean, held = summary(rows)
        gap = f"{mean - base[1]:+.4f}" if run != "bf16" else "—"
        hgap = (f"{held - base[2]:+.4f}" if run != "bf16" and held is not None and base[2] is not None
                else "—")
        lines.append(f"| {run_label(run)} | {final:.4f} | {mean:.4f} | {gap} | "
                     f"{(f'{held:.4f}' if held is not None else '—')} | {hgap} | {secs[run]:.0f} |")
    return lines


# --- the figure ---------------------------------------------------------------------------------

def draw(a, curves, path):
    steps = max(len(rows) for rows in curves.values())
    top1, h1, top2, h2, top3, h3 = 70, 230, 350, 160, 560, 150
    height = top3 + h3 + 50
    title = "Stage 06 on the language model under each recipe, beside bf16 and fp32"
    sub = (f"H {a.hidden}, NH {a.heads}, NKV {a.kv_heads}, F {a.ffn}, L {a.layers}, V {a.vocab}, "
           f"S {a.seq}, B {a.batch} | AdamW lr {a.lr:g} | {steps} steps | np {a.np} | "
           "device cpu (FP8 emulated)")
    names = [run_label(r) for r in curves]
    W = LEFT + PLOT + legend_width(names)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" '
           'font-family="sans-serif" font-size="12">',
           f'<title>{escape(title)}</title>',
           f'<rect width="{W}" height="{height}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
           f'<text x="{W / 2}" y="42" text-anchor="middle" fill="#444">{escape(sub)}</text>']
    width = {"bf16": 1.8, "fp32": 1.4}

    def series(col, dashed):
        return [(r, COLORS[r], [(x[0], x[col]) for x in rows], dashed, width.get(r, 1.2))
                for r, rows in curves.items()]

    def bounds(ser, pad=0.03):
        v = [y for _, _, pts, _, _ in ser for _, y in pts if y is not None]
        p = pad * (max(v) - min(v)) or 0.01
        return min(v) - p, max(v) + p

    train = series(1, False)
    lo, hi = bounds(train)
    out.append(f'<text x="{LEFT}" y="{top1 - 8}">training loss (each step\'s batch, before its '
               'update)</text>')
    panel(out, top1, h1, steps, lo, hi, train, "loss", lambda v: f"{v:.2f}")
    held = series(2, True)
    lo, hi = bounds(held)
    out.append(f'<text x="{LEFT}" y="{top2 - 8}">held-out loss, dashed (every {a.eval_every} '
               'steps and the last)</text>')
    panel(out, top2, h2, steps, lo, hi, held, "held-out", lambda v: f"{v:.2f}")
    base = {r[0]: r[1] for r in curves["bf16"]}
    gap = [(r, COLORS[r], [(x[0], x[1] - base[x[0]]) for x in rows if x[0] in base], False,
            width.get(r, 1.2)) for r, rows in curves.items()]
    # The first steps move fast and their gaps are large and uninformative: the scale is set by
    # the second half of the run.
    half = [v for _, _, pts, _, _ in gap for i, v in pts if i >= steps // 2]
    m = max(abs(v) for v in half) * 1.3 or 0.01
    out.append(f'<text x="{LEFT}" y="{top3 - 8}">training loss − bf16\'s, same batch (scale set '
               'by the second half of the run; earlier values clipped)</text>')
    panel(out, top3, h3, steps, -m, m, gap, "− bf16", lambda v: f"{v:+.3f}")
    out.append(f'<text x="{LEFT + PLOT / 2}" y="{height - 12}" text-anchor="middle">'
               'AdamW step</text>')
    for k, (run, color, _, _, w) in enumerate(train):
        yy = top1 + 14 + 18 * k
        out.append(f'<line x1="{LEFT + PLOT + 10}" x2="{LEFT + PLOT + 36}" y1="{yy}" y2="{yy}" '
                   f'stroke="{color}" stroke-width="{w + 0.8}"/>')
        out.append(f'<text x="{LEFT + PLOT + LEGEND_LINE}" y="{yy + 4}">'
                   f'{escape(run_label(run))}</text>')
    out.append("</svg>")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(out) + "\n")
    os.replace(tmp, path)


# --- the page and the chapter's tables ---------------------------------------------------------

def tables(a, errors, curves, secs):
    g = errors["gemms"]
    layers = len({(x["layer"], x["weight"]) for x in g})
    return [
        f"**GEMM error against fp64** on the operands of step {errors['step']} of the fp32 "
        f"model (after {errors['step']} AdamW updates; {layers} weight matrices, seven per "
        f"block, each with its three GEMMs; rowwise scales K cut into the {errors['emulate_ranks']} ranks' shards "
        "where the stage shards it). Rel. Frobenius: ‖C − C*‖_F / ‖C*‖_F pooled over the "
        "layers (the worst layer in brackets); max elem. error: max |C − C*| / max |C*|, the "
        "worst layer's.",
        "",
        *gemm_table(errors),
        "",
        f"**Loss** of stage 06 at {a.np} ranks, {len(curves['bf16'])} steps: the gap is the mean "
        f"training loss of the last {LAST} steps (and the final held-out loss) less bf16's.",
        "",
        *loss_table(curves, secs),
    ]


def write_md(a, errors, curves, secs, total, command, path):
    rel_svg = os.path.relpath(os.path.abspath(a.svg), os.path.dirname(os.path.abspath(path)))
    lines = [
        "# Accuracy of the low-precision recipes",
        "",
        "What each of stage 06's `--fp8-recipe` recipes costs in accuracy, on the language model "
        "(chapter 6, \"Accuracy of the recipes\", reads these numbers). The GEMM errors are "
        "measured by `recipe_gemm_error` (`tools/recipe_gemm_error.cc`): it trains the model in "
        "fp32 on one rank and, at the last step, quantizes both operands of every linear layer's "
        "forward, input-gradient and weight-gradient GEMM exactly as stage 06 does under the "
        "recipe (`common/lowp.h`'s quantizer, each operand's role and the GEMM's reduction "
        "dimension along the blocks), multiplies the dequantized operands in double and "
        "compares with the product of the unquantized operands in double. The loss curves are "
        "stage 06 itself under each recipe, and under `--dtype bf16` and `--dtype fp32`. All of "
        "it is CPU emulation: the FP8 casts are bit-exact, the GEMMs multiply dequantized "
        "operands in fp32. The figure, this page and the tables of chapter 6 are written by one "
        "command:",
        "",
        "```sh",
        command,
        "```",
        "",
        f"{lm_curves.sizes_text(a)}; stage 06 on {a.np} ranks. Device: cpu. The whole command "
        f"took {total / 60:.1f} minutes on a 2-core machine (each run's seconds: below).",
        "",
        f"![Training and held-out loss of stage 06 under each recipe, bf16 and fp32]({rel_svg})",
        "",
        *tables(a, errors, curves, secs),
        f"| recipe_gemm_error (fp32, 1 rank, {a.steps} steps, then the measurement) | | | | | | "
        f"{secs['gemm']:.0f} |",
        "",
    ]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines))
    os.replace(tmp, path)


def write_chapter(a, errors, curves, secs, path):
    """The tables between the chapter's markers, when it has them; else nothing."""
    if not path or not os.path.isfile(path):
        return False
    text = open(path).read()
    i, j = text.find(MARK_BEGIN), text.find(MARK_END)
    if i < 0 or j < i:
        return False
    body = "\n".join(tables(a, errors, curves, secs))
    new = text[:i + len(MARK_BEGIN)] + "\n" + body + "\n" + text[j:]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", required=True, help="where 06_fp8 and recipe_gemm_error are")
    ap.add_argument("--data", help="a token file (default: the build's corpus, "
                    "<bin-dir>/../data/kjv-4096.tokens), or synthetic")
    ap.add_argument("--vocab", type=int, default=256, help="--data synthetic's vocabulary")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="which, comma-separated")
    ap.add_argument("--np", type=int, default=2, help="stage 06's ranks")
    lm_curves.add_model_flags(ap, hidden=256, heads=4, kv_heads=4, ffn=512, layers=2, seq=32,
                              batch=8, steps=120, eval_every=10)
    ap.add_argument("--svg", default="docs/figures/06_recipe_accuracy.svg")
    ap.add_argument("--md", default="docs/recipe-accuracy.md")
    ap.add_argument("--chapter", default="06_fp8/README.md",
                    help="a page whose recipe-accuracy markers receive the tables ('' for none)")
    ap.add_argument("--work", default="build/recipe_accuracy",
                    help="a directory for the runs (replaced)")
    ap.add_argument("--mpirun", default="mpirun --oversubscribe --bind-to none",
                    help="launcher and its flags (-np N is added)")
    a = ap.parse_args()
    t_start = time.monotonic()
    a.recipe_list = parse_recipes(a.recipes)
    for name in ("np", "steps", "eval_every"):
        if getattr(a, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(a, name)})")
    if a.steps <= LAST:
        fail(f"--steps must be > {LAST} (the tables average the last {LAST} steps)")
    check_sizes(a)
    for exe in ("recipe_gemm_error", lm_curves.STAGES["06"][0]):
        path = os.path.join(a.bin_dir, exe)
        if not os.path.isfile(path):
            fail(f"--bin-dir: no executable '{path}' (build the targets 06_fp8 and "
                 "recipe_gemm_error)")
    if a.data is None:
        a.data = os.path.normpath(os.path.join(a.bin_dir, "..", "data", "kjv-4096.tokens"))
    if a.data != "synthetic":
        if not os.path.isfile(a.data):
            fail(f"--data: no token file '{a.data}' (the build makes it where Debian's bible-kjv "
                 "is installed; or --data synthetic)")
        with open(a.data, "rb") as f:
            a.vocab = lm_curves.read_token_header(f, a.data)[0]
    if os.path.exists(a.work):
        shutil.rmtree(a.work)
    os.makedirs(a.work)

    command = "tools/recipe_accuracy.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    errors, gemm_secs = gemm_errors(a)
    curves, secs = train_runs(a)
    secs["gemm"] = gemm_secs
    for r in a.recipe_list:
        print(f"{r:<11} " + "  ".join(f"{k} {pooled(errors['gemms'], r, k)[0]:.2e}" for k in KINDS))
    for run, rows in curves.items():
        final, mean, held = summary(rows)
        print(f"{run_label(run):<15} final {final:.4f}  last {LAST} {mean:.4f}  held-out "
              f"{held if held is None else round(held, 4)}")
    draw(a, curves, a.svg)
    write_md(a, errors, curves, secs, time.monotonic() - t_start, command, a.md)
    wrote = [a.svg, a.md]
    if write_chapter(a, errors, curves, secs, a.chapter):
        wrote.append(a.chapter)
    print(f"wrote {', '.join(wrote)} ({(time.monotonic() - t_start) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    tool_errors.run(main, "recipe_accuracy")
