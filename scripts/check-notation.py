#!/usr/bin/env python3
"""Checks the chapters' formulas against the symbol table of docs/README.md ("Symbols").

One symbol has one meaning in every chapter, and a few are easy to take for another, because a
paper or the code uses them so. In the formulas of a page — its inline code spans, its `math`
and `text` blocks (not program output, marked `<!-- output: … -->`, and not code) — these are
refused, each with the symbol the table gives it:

    head dimension as D           `NKV·D`, `S×S×D`, `S²·D`, `[S, D]`, `\\sqrt{D}`, `D = 128`   D is the DP size: Dh
    scores as S                   `dS`, `S = Q·Kᵀ`, `S_ij`                                   S is the sequence: Z, dZ
    scores as s_j                 `e^{s_j}`, `s_j`                                           s is the SwiGLU output: z_j
    F for a rate                  `F/BW`, `…/F`, "`F` FLOP/s"                               F is the SwiGLU width: FLOPS
    s as a size                   `s = S/…`, `[s, …]`                                        s is a tensor: S_r
    G as a tensor                 `G = [S, …]`                                               G is NH/NKV

In chapter 9, where a part of the model's layers is a pipeline stage and "stage 09" is the
program, the prose (paragraphs joined, code and output left out) may not say "the stage", "a
stage", "each stage", … for either: it says "pipeline stage", "virtual stage", "this stage" or
"stage 09".

Prints each as `page:line: …` and exits 1 if there is any. --self-test plants each in a scratch
page and expects it found, and the right forms not reported.

Usage: scripts/check-notation.py [PAGE.md ...]   (default: the chapters and docs/*.md)
       scripts/check-notation.py --self-test
"""
import pathlib
import re
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
RULES = [
    (re.compile(r"\b(?:NH|NKV)\s*·\s*D\b|S\s*×\s*S\s*×\s*D\b|S²\s*·\s*D\b|\[S, D\]|\\sqrt\{D\}"
                r"|\bD = (?:32|64|128)\b|/D\)|[−-]2i/D\b|\bD/2\b"),
     "the head dimension is Dh (D is the DP size)"),
    (re.compile(r"\bdS\b|\bS\s*=\s*Q\s*·?\s*K|\bS_\{?ij\b"),
     "attention scores are Z and dZ (S is the sequence length)"),
    (re.compile(r"\bs_\{?j\b"), "scores are z_j (s is the SwiGLU output)"),
    (re.compile(r"\bF\s*/\s*BW\b|/\s*F\b(?![\w/·])|^F FLOP/s$"),
     "a compute rate is FLOPS (F is the SwiGLU width)"),
    (re.compile(r"\bs\s*=\s*S\s*/|\[s, "), "a size is upper case: s is the SwiGLU output"),
    (re.compile(r"\bG\s*=\s*\["), "G is NH/NKV, not a tensor"),
]
BARE_STAGE = re.compile(r"\b(?:[Tt]he|[Aa]|[Ee]ach|[Ee]very|[Nn]ext|[Ll]ast|[Pp]revious|[Oo]ther|[Oo]ne"
                        r"|per|its|[Ww]hole)\s+stages?\b(?!\s*0\d)")
PIPELINE_CHAPTER = "09_pipeline_parallel"
SPAN = re.compile(r"`([^`]+)`")
FENCE = re.compile(r"^\s*```\s*(\w*)")


def formulas(lines):
    """(line number, formula text) of a page: code spans of its prose, math and text blocks."""
    fence, output = None, False
    for n, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1) or "text"
                output = n > 1 and lines[n - 2].startswith("<!-- output")
            else:
                fence = None
            continue
        if fence is None:
            for span in SPAN.findall(line):
                yield n, span
            # "at `F` FLOP/s": the span alone is a letter; the prose around it says what it is.
            for m in re.finditer(r"`F` FLOP/s", line):
                yield n, "F FLOP/s"
        elif fence in ("math", "text") and not output:
            yield n, line


def paragraphs(lines):
    """(first line number, text) of each prose paragraph: no code, output, table or heading."""
    fenced, para = False, []
    for n, line in enumerate(lines + [""], 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or line.lstrip().startswith("```") or not line.strip() or \
                line.startswith(("#", "<!--", "|")):
            if para:
                yield para[0][0], " ".join(text for _, text in para)
            para = []
        else:
            para.append((n, line))


def problems(page):
    lines = page.read_text().splitlines()
    found = []
    if PIPELINE_CHAPTER in str(page.resolve()):
        for n, text in paragraphs(lines):
            for m in BARE_STAGE.finditer(text):
                found.append(f"{page}:{n}: {m.group(0)!r} in the paragraph from this line: say "
                             "\"pipeline stage\" (or \"virtual stage\", \"stage 09\")")
    for n, text in formulas(lines):
        for rule, why in RULES:
            m = rule.search(text)
            if m:
                found.append(f"{page}:{n}: {m.group(0).strip()!r} in {text.strip()!r}: {why}")
    return found


SELF_TEST_BAD = [
    "saved `2·S·B·NKV·D` bytes", "four `S×S×D` products", "`2·B·NH·S²·D` FLOPs",
    "the `[S, D]` head matrices", "```math\nZ = \\frac{QK^\\top}{\\sqrt{D}}\n```", "at `D = 128`",
    "`φ = p·θ^(−2i/D)`", "the pair `(x_i, x_(i+D/2))`",
    "`P` (and `dS` in backward)", "products (`S = Q·Kᵀ`, …)", "`lse = log Σ_j e^{s_j}`",
    "at `F` FLOP/s and", "`c ≥ F/BW`", "```text\ncompute ≥ gather:   2 · S · B · Ψ_l / F  ≥  x\n```",
    "`s = S/(C·T)` tokens per rank", "`[s, n, H]`", "outputs (`G = [S, b, H]` each)",
]
SELF_TEST_GOOD = (
    "saved `2·S·B·NKV·Dh` bytes, four `S×S×Dh` products, `2·B·NH·S²·Dh`, `[S, Dh]`, `Dh = 128`,\n"
    "`D = 2` replicas, `B/D` sequences, `(D − 1)/D`, `dZ`, `Z = Q·Kᵀ`, `e^{z_j}`, `FLOPS/BW`,\n"
    "`[F/T, H]`, `F/T`, `4·S·B·H·F`, `S_r = S/(C·T)`, `[S_r, n, H]`, `G = NH/NKV`, `s = silu(gate)·up`,\n"
    "`--dp 128`, `x_(i+Dh/2)`.\n\n```math\nZ = \\frac{QK^\\top}{\\sqrt{D_h}}\n```\n\n"
    "<!-- output: build/bin/01_baseline | head -1 -->\n```text\nH 256 NH 8 NKV 8 (D 32) F 1024\n```\n\n"
    "```cpp\nfor (int n = 0; n < D / 2; ++n) dS[n] = S_ij;\n```\n")


def self_test():
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        page = pathlib.Path(tmp) / "page.md"
        for bad in SELF_TEST_BAD:
            page.write_text(f"Some text\n{bad}\n")
            if len(problems(page)) != 1:
                print(f"self-test: {bad!r}: {problems(page) or 'not found'}")
                ok = False
        chapter = pathlib.Path(tmp) / PIPELINE_CHAPTER / "README.md"
        chapter.parent.mkdir()
        chapter.write_text("The price is idle time: a stage cannot start before the previous\n"
                           "one hands it something.\n")
        if len(problems(chapter)) != 1:
            print(f"self-test: a bare stage in chapter 9: {problems(chapter) or 'not found'}")
            ok = False
        chapter.write_text("The price is idle time: a pipeline stage cannot start before the\n"
                           "previous one, and virtual stage 2 waits. This stage (stage 09) runs\n"
                           "stage 08 inside each pipeline stage.\n\n```text\nthe stage\n```\n")
        page.write_text(SELF_TEST_GOOD)
        for p in problems(page) + problems(chapter):
            print(f"self-test: a right form was reported: {p}")
            ok = False
    print("self-test:", "every planted clash found, the right forms not reported" if ok else "FAILED")
    return ok


def main():
    if sys.argv[1:] == ["--self-test"]:
        return 0 if self_test() else 1
    pages = [pathlib.Path(a) for a in sys.argv[1:]]
    pages = pages or sorted(ROOT.glob("[0-9][0-9]_*/README.md")) + sorted(ROOT.glob("docs/*.md"))
    found = [p for page in pages for p in problems(page)]
    for p in found:
        print(p)
    print(f"{len(pages)} pages, {len(found)} symbols against the symbol table", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
