#!/usr/bin/env python3
"""The step-time cost of a checkpoint save, synchronous and asynchronous, from the stages' --json.

Runs one stage three ways on the same config and seed: without saves, with --save-every K
(each save written in the step loop), and with --save-every K --async-save (the loop takes a host
copy and a writer thread writes it while the next steps run). From each run's --json:

    step ms          the mean `ms` of the steps after step 0 that follow no save (step 0 warms up)
    after a save     the mean `ms` of the steps that follow a save (under --async-save the writer
                     thread is writing while they run; it competes with them for the cores)
    extra            after a save less step ms, within the one run (a load that changes between
                     runs moves both alike)
    blocked per save the mean `save_ms`: how long each save held the step loop (the whole write,
                     or the host copy and the wait for the previous save's writer)
    final wait       `save_final_wait_ms`: the last asynchronous save, waited for after the last step

Each is the median over R runs. The table goes into docs/benchmarks.md between
`<!-- tpx-bench:begin checkpoint -->` and `<!-- tpx-bench:end checkpoint -->` (before the page's
last section, How this page is made, the first time), or to --out.

Usage: scripts/checkpoint-cost.py [--build DIR] [--stage NAME] [--ranks N] [--repeats R]
                                  [--out FILE] [-- STAGE FLAGS ...]
The environment is scripts/env.sh's (sourced here for mpirun).
"""
import argparse
import datetime
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
NAME = "checkpoint"
DEFAULT_FLAGS = ("--task lm --data synthetic --vocab 1024 --hidden 128 --heads 8 --ffn 512 "
                 "--seq 64 --batch 2 --layers 4 --optimizer adamw --lr 1e-3 --steps 13")
EVERY = 3  # a save after steps 3, 6, 9, 12 and at the end (13)


def run(build, stage, ranks, flags, extra, work, tag):
    out = work / f"{tag}.json"
    cmd = (f"source scripts/env.sh && \"${{TPX_MPIRUN[@]}}\" -np {ranks} {build}/bin/{stage} "
           f"{flags} {extra} --json {out} > {work / (tag + '.log')}")
    p = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"checkpoint-cost: {stage} {extra} failed (exit {p.returncode}): "
                 f"{(p.stderr or p.stdout).strip()[-400:]}")
    return json.loads(out.read_text())


def measure(summary):
    """(step ms, ms of steps after a save, their difference, blocked ms per save, final wait ms)
    of one run."""
    rows = summary["steps"]
    after = {r["step"] + 1 for r in rows if r.get("saved")}
    plain = [r["ms"] for r in rows if r["step"] > 0 and r["step"] not in after]
    following = [r["ms"] for r in rows if r["step"] in after]
    saves = [r["save_ms"] for r in rows if r.get("saved")]
    after_ms = statistics.mean(following) if following else None
    return (statistics.mean(plain), after_ms,
            after_ms - statistics.mean(plain) if following else None,
            statistics.mean(saves) if saves else None,
            summary.get("save_final_wait_ms"))


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def cell(v):
    return "–" if v is None else f"{v:.1f}"


def replace_section(text, body):
    begin, end = f"<!-- tpx-bench:begin {NAME} -->", f"<!-- tpx-bench:end {NAME} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text:
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    method = "<!-- tpx-bench:begin method -->"
    if method in text:
        head, rest = text.split(method, 1)
        return head + block + "\n\n" + method + rest
    return text.rstrip("\n") + "\n\n" + block + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build-cpu", help="the build tree whose bin/ runs")
    ap.add_argument("--stage", default="02_megatron_tp")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=pathlib.Path, help="write the page here (default: the docs')")
    ap.add_argument("flags", nargs="*", help="the stage's flags (default: %(default)s)")
    a = ap.parse_args()
    flags = " ".join(shlex.quote(f) for f in a.flags) if a.flags else DEFAULT_FLAGS
    modes = [("no save", ""), ("sync", f"--save-every {EVERY}"),
             ("async", f"--save-every {EVERY} --async-save")]
    load_before = os.getloadavg()[0]
    results = {m: [] for m, _ in modes}
    size = None
    with tempfile.TemporaryDirectory(prefix="tpx-ckpt-cost-") as tmp:
        work = pathlib.Path(tmp)
        for r in range(a.repeats):
            for mode, extra in modes:  # interleaved, so that a change of load hits every mode
                tag = f"{mode.replace(' ', '_')}-{r}"
                save = f"--save {work / tag}" if extra else ""
                summary = run(a.build, a.stage, a.ranks, flags, f"{extra} {save}", work, tag)
                results[mode].append(measure(summary))
                if extra and size is None:
                    last = max(p for p in (work / tag).iterdir() if p.name.startswith("step-"))
                    size = sum(f.stat().st_size for f in last.glob("rank-*.bin"))
    load_after = os.getloadavg()[0]
    cpu = platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in
                  pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), cpu) if pathlib.Path(
                      "/proc/cpuinfo").exists() else cpu
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "scripts/checkpoint-cost.py" + (f" --build {a.build}" if a.build != "build-cpu"
                                              else "") + \
        (f" --stage {a.stage} --ranks {a.ranks}" if a.stage != "02_megatron_tp" or a.ranks != 2
         else "") + (f" --repeats {a.repeats}" if a.repeats != 3 else "") + \
        (" -- " + flags if a.flags else "")
    lines = [
        "## Checkpoint saves (cpu)",
        "",
        f"Device: cpu: {model}, {os.cpu_count()} cores. Date: {date}. Command: `{command}`, "
        f"written by it from the runs' `--json` (1-minute load average {load_before:.2f} before, "
        f"{load_after:.2f} after).",
        "",
        "**CPU-backend timings**: the ranks share the machine's cores, so an asynchronous save's "
        "writer thread competes with the steps for them; on a GPU the steps run on the device "
        "and the thread on an otherwise idle host core.",
        "",
        f"`mpirun -np {a.ranks} {a.stage} {flags}`, {a.repeats} run{'s' if a.repeats > 1 else ''} each: no saves, "
        f"`--save DIR --save-every {EVERY}` (a save after steps 3, 6, 9, 12 and at the end), "
        f"and the same with `--async-save`. Each save writes {size / 2**20:.1f} MiB "
        "(every rank's `rank-<r>.bin`; the fp32 weights and AdamW's two moments). "
        "Step ms: the mean `ms` of the steps after step 0 that follow no save; after a save: of "
        "the steps that follow one; extra: the two's difference within each run (the machine's load "
        "changes between runs, so compare the rows' step ms with care); blocked per save: the mean `save_ms`, the time each save "
        "held the step loop (not part of any step's `ms`); final wait: `save_final_wait_ms`, "
        "the last asynchronous save waited for after the last step. Medians over the runs, "
        "milliseconds.",
        "",
        "| saves | step ms | step ms after a save | extra ms after a save | blocked per save "
        "(ms) | final wait (ms) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, _ in modes:
        got = results[mode]
        lines.append(f"| {mode} | " + " | ".join(
            cell(median([g[k] for g in got])) for k in range(5)) + " |")
    page = a.out or PAGE
    text = page.read_text() if page.is_file() else ""
    page.write_text(replace_section(text, "\n".join(lines)))
    print("\n".join(lines[-5:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
