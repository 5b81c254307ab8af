"""docs/benchmarks.md's text: its intro, its sections and subsections between their markers, the
line of what ran, and a command as the page shows it.
"""
import re
import shlex

from .config import MESH_STAGES, SECTIONS, STAGES, BenchError, rel, split_label
from .tables import read_csv_rows


def benchmarks_md(md):
    """benchmarks.md as it stands (empty if new), with the current intro and closing text
    (METHOD, after every section) and a placeholder for every section it does not have yet."""
    text = replace_intro(md.read_text() if md.is_file() else "", INTRO)
    for name in SECTIONS:
        if f"<!-- tpx-bench:begin {name} -->" not in text:
            text = replace_section(text, name, PLACEHOLDER[name])
    return replace_section(text, "method", METHOD)  # not in SECTIONS: after them all


def replace_section(text, name, body):
    """text with the section NAME's body replaced (or added, in SECTIONS' order)."""
    begin, end = f"<!-- tpx-bench:begin {name} -->", f"<!-- tpx-bench:end {name} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text:
        if end not in text:
            raise BenchError(f"section '{name}' has a begin marker and no end marker")
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    # Before the first section that comes after it in SECTIONS' order, or at the end.
    for later in SECTIONS[SECTIONS.index(name) + 1:] if name in SECTIONS else []:
        marker = f"<!-- tpx-bench:begin {later} -->"
        if marker in text:
            head, rest = text.split(marker, 1)
            return head + block + "\n\n" + marker + rest
    return text.rstrip("\n") + "\n\n" + block + "\n"


def replace_intro(text, intro):
    """text with everything before its first section replaced by intro."""
    cut = text.find("<!-- tpx-bench:begin ")
    return intro.rstrip("\n") + "\n\n" + (text[cut:] if cut >= 0 else "")


INTRO = """# Benchmarks

tpx against PyTorch on the same GPU comes first: the **CUDA** section's table puts each published
GPU run side by side (stage 01's training step against PyTorch eager and `torch.compile`, the
fused attention against SDPA at each sequence length, the block's GEMMs against the GEMM peak the
run measured), and each run's subsection has the tables behind it, with the log of every number.
The **CPU** section shows the mechanics of every stage (bytes, the structure of the overlap,
relative cost), not GPU speed; the **projection** estimates the stages on many GPUs. How the
numbers are made and how to make them again is the last section, How this page is made."""

# After the sections: what each is and how to regenerate them.
METHOD = """## How this page is made

- **CUDA** and **CPU**: the stages run under `mpirun` with `--json` over several rank counts and
  configs, each point repeated (each section says which, written from what ran); then the
  micro-benchmarks on the same device: GEMM throughput at the block's shapes, the chunked GEMMs
  of the ring stages (efficiency against N), and the collectives in nccl-tests' convention.
  Stage 08 has a subsection of its own: its meshes at two sequence lengths beside stage 03, and
  its attention time against S for C = 1, 2, 4. Stage 09 has one too: each pipeline schedule at
  P = 2 and 4 over the number of micro-batches M, its measured bubble against the schedule's
  formula. On cuda the micro-benchmarks time only what they name (bf16 tensors in and out,
  device events; a published run made before that says so beside its numbers).
- **Projection**: the step time of each stage on N H100 SXM GPUs from the projection model
  (`tools/projection.h`), and of a Llama-3-70B-shaped stack on 4-D meshes (PP × DP × CP × TP) of
  64 and 512 GPUs; projected, not measured; then the model against published results,
  held-out cases first, and how far each error moves with each assumption.

Regenerate with `scripts/bench.sh` (CPU section and projection) or `scripts/bench.sh --device
cuda` on a GPU machine (CUDA section and projection); each run replaces only its own sections.
`scripts/bench.sh --from-logs docs/gpu-runs/DATE-GPU` publishes a GPU run made elsewhere: it
writes the CUDA section from that folder's logs (runs nothing; every number names its log);
`--from-logs` given again keeps several runs, newest first, each labelled with its GPU.
`scripts/bench.sh --stages 04,05 --ranks 2,4 [--model NAME | --config FILE]` runs a selection
(into `out/bench/` unless `--out` is given).
`tools/bench.py --only projection --build DIR` replaces the projection alone (no stage runs).
`tools/bench.py --only text` rewrites the text at the top and here and each section's line of
what ran, from the section's CSV (runs nothing). `scripts/bench.sh --only cp` reruns only stage
08's subsection of its device's section (with its own date, command and load average);
`scripts/bench.sh --only pp` likewise stage 09's.
No number in this file is typed by hand: all of it is written by `tools/bench.py`."""

PLACEHOLDER = {
    "cpu": "## CPU\n\nNot generated yet: `scripts/bench.sh` writes this section.",
    "cuda": "## CUDA\n\nNot generated yet: `scripts/bench.sh --device cuda` on a GPU machine, "
            "or `scripts/bench.sh --from-logs DIR` from a GPU run's logs, writes this section.",
    "projection": "## Projection (H100 SXM, projected)\n\nNot generated yet: `scripts/bench.sh` "
                  "writes this section.",
}


def mesh_points_of(rows):
    """{mesh stage: its (N, degree) points} for the mesh stages the rows have."""
    points = {}
    for r in rows:
        exe, _, degree = split_label(r["stage"])
        if degree is not None:
            points.setdefault(exe, set()).add((int(r["n"]), int(degree)))
    return {exe: sorted(p) for exe, p in points.items()}


def ran_text(stages, ranks, configs, repeats, steps, quick, mesh_points=None):
    """The sentence that says what the section's sweep ran, from the sweep itself (each mesh
    stage's points: `mesh_points`, else every point of MESH_STAGES within `ranks`)."""
    names = [f"`{s}`" for s in stages]
    listed = (names[0] if len(names) == 1 else
              f"{', '.join(names[:-1])} and {names[-1]}")
    meshes = []
    for stage in stages:
        if stage not in MESH_STAGES:
            continue
        letter, _, _, default = MESH_STAGES[stage]
        chosen = mesh_points.get(stage, []) if mesh_points is not None else default
        points = [f"{letter} {x} × TP {n // x}" for n, x in chosen if n in ranks]
        if points:
            meshes.append(f"`{stage}` on the meshes {', '.join(points)}")
    mesh = f" ({'; '.join(meshes)})" if meshes else ""
    cfgs = ", ".join(f"`{c['name']}`" for c in configs)
    return (f"{'Quick mode. ' if quick else ''}Ran {listed} over N = "
            f"{', '.join(map(str, ranks))}{mesh}; config{'s' if len(configs) > 1 else ''} {cfgs}; "
            f"{repeats} repeat{'s' if repeats > 1 else ''} of {steps} steps per point.")


def fenced(cmd):
    """A command as a fenced shell block (markdown lines)."""
    return ["```sh", show(cmd), "```"]


def show(cmd):
    """A command as the tables print it: paths inside the repository relative to it, quoted for
    the shell where needed (placeholders such as <N> as they are)."""
    out = []
    for c in cmd:
        m = re.match(r"^(--[\w-]+=)?(/.*)$", c)
        c = (m.group(1) or "") + rel(m.group(2)) if m else c
        out.append(shlex.quote(c) if re.search(r"[^\w@%+=:,./<>-]", c) else c)
    return " ".join(out)


def section_body(text, name):
    """The text between the section NAME's markers ("" if it has none)."""
    begin, end = f"<!-- tpx-bench:begin {name} -->", f"<!-- tpx-bench:end {name} -->"
    if begin not in text:
        return ""
    return text.split(begin, 1)[1].split(end, 1)[0]


def ran_text_from_csv(path):
    """ran_text() for a section already written, from its CSV: the stages, N and configs that
    have rows, and the repeats and steps the rows record."""
    rows = read_csv_rows(path)
    if not rows:
        raise BenchError(f"{path} has no rows")
    stages = [s for s in STAGES if any(split_label(r["stage"])[0] == s for r in rows)]
    ranks = sorted({int(r["n"]) for r in rows})
    configs = [{"name": c} for c in dict.fromkeys(r["config"] for r in rows)]
    return ran_text(stages, ranks, configs, int(rows[0]["repeats"]), int(rows[0]["steps"]), False,
                    mesh_points_of(rows))


def replace_subsection(text, device, name, block):
    """text with the subsection NAME (block: its lines, markers included) replaced, or put into
    the device's section before its micro-benchmarks (or at its end) if it has none yet: after
    the subsections before it."""
    marker = f"{device}-{name}"
    if f"<!-- tpx-bench:begin {marker} -->" in text:
        return replace_section(text, marker, "\n".join(block[1:-1]))
    begin, end = f"<!-- tpx-bench:begin {device} -->", f"<!-- tpx-bench:end {device} -->"
    body = section_body(text, device)
    micro = f"\n### Micro-benchmarks ({device})\n"
    at = (text.index(begin) + len(begin) + body.index(micro) + 1 if micro in body
          else text.index(end))
    head = text[:at] if text[:at].endswith("\n\n") else text[:at].rstrip("\n") + "\n\n"
    return head + "\n".join(block) + "\n\n" + text[at:]
