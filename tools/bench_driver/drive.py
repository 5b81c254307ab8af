"""The command line and what it runs: the whole sweep, --only one part, the text alone, or a GPU
run's logs (--from-logs).
"""
import argparse
import json
import os
import pathlib
import re
import shlex
import sys

from .config import (CP_STAGE, PP_STAGE, REFERENCE_STAGE, ROOT, SECTIONS, STAGES, SUBSECTIONS,
                     BenchError, rel)
from .arithmetic import add_derived
from .tables import ATTENTION_FIELDS, CP_CSV_FIELDS, PP_FIELDS, write_csv
from .page import benchmarks_md, ran_text_from_csv, replace_section, replace_subsection
from .microbench import device_description, load_average, measured_peak
from .runner import Driver
from .plots import plot, plot_cp_attention, plot_pp_bubble
from .render import Render
from .verify import missing_outputs, verify, verify_cp, verify_pp
from .projection import GPU_DEVICE_FILE, drive_projection, measured_check, projection_section


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--build", default=str(ROOT / "build"), help="build directory (has bin/)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--repeats", type=int, default=3, help="runs per point (default 3)")
    ap.add_argument("--quick", action="store_true",
                    help="1 repeat, N = 1, 2, 3 steps, --max-bytes 64K, the default config only")
    ap.add_argument("--out", help="where benchmarks.md goes (default: docs/; with a selection, "
                                  "WORK/<device>/page)")
    ap.add_argument("--stages", type=stage_list, metavar="04,05",
                    help="only these stages (numbers or names, comma-separated)")
    ap.add_argument("--ranks", type=rank_list, metavar="2,4",
                    help="only these rank counts N (comma-separated)")
    model = ap.add_mutually_exclusive_group()
    model.add_argument("--model", metavar="NAME",
                       help="one config: this preset, forwarded to every stage and tpx_project")
    model.add_argument("--config", metavar="FILE",
                       help="one config: this file, forwarded to every stage and tpx_project")
    ap.add_argument("--work", default=str(ROOT / "out" / "bench"),
                    help="raw --json files and logs (a folder per device)")
    ap.add_argument("--mpirun", default="mpirun --oversubscribe --bind-to none")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per program run")
    ap.add_argument("--command", help="the command to print as the one that made the tables")
    ap.add_argument("--from-logs", metavar="DIR", action="append",
                    help="write the CUDA section from a GPU run's log folder (runs nothing); "
                         "given again, one subsection per run, the first the newest")
    ap.add_argument("--only", choices=["projection", "text", "cp", "pp"],
                    help="regenerate only part of benchmarks.md: projection (runs tpx_project "
                         "alone, no stage runs), text (the intro, and each device section's "
                         "line of what ran, from its CSV; runs nothing) or cp (stage 08's "
                         "subsection: bench_gemm's peak, then its stage table and attention "
                         "against S) or pp (stage 09's subsection: each schedule's bubble "
                         "against M)")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    if a.command is None:
        a.command = shlex.join(["tools/bench.py"] + (sys.argv[1:] if argv is None else argv))
    missing_run = next((d for d in a.from_logs or [] if not pathlib.Path(d).is_dir()), None)
    bad_path = (f"--config {a.config}: no such file" if a.config and
                not pathlib.Path(a.config).is_file() else
                f"--from-logs {missing_run}: no such directory" if missing_run else
                f"--build {a.build}: no such directory"
                if a.only != "text" and not a.from_logs and not pathlib.Path(a.build).is_dir()
                else None)
    if bad_path:  # one line and exit 2, as every tool in tools/ answers a bad path
        print(f"bench: error: {bad_path}", file=sys.stderr)
        return 2
    if a.out is None:
        selection = a.stages or a.ranks or a.model or a.config
        a.out = str(pathlib.Path(a.work) / a.device / "page") if selection else str(ROOT / "docs")
    try:
        return drive(a)
    except BenchError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 1


def stage_list(text):
    """--stages: "04,05" or "04_overlap_ring,5" as STAGES' names, in STAGES' order."""
    chosen = []
    for token in filter(None, (t.strip() for t in text.split(","))):
        hits = [s for s in STAGES if s == token or (token.isdigit() and int(s[:2]) == int(token))]
        if not hits:
            raise argparse.ArgumentTypeError(
                f"no stage '{token}' (stages: {', '.join(s[:2] for s in STAGES)}, or their names)")
        chosen += hits
    if not chosen:
        raise argparse.ArgumentTypeError("no stage given")
    return [s for s in STAGES if s in chosen]


def rank_list(text):
    """--ranks: "2,4" as sorted distinct positive integers."""
    try:
        ranks = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of integers")
    if not ranks or ranks[0] < 1:
        raise argparse.ArgumentTypeError(f"'{text}': rank counts are positive integers")
    return ranks


def drive_text(out):
    """--only text: the intro, and the "Ran ..." line of each device section that has a CSV,
    written before the section's "Each point:" paragraph (replacing the one there)."""
    md = out / "benchmarks.md"
    text = benchmarks_md(md)
    for device in ("cpu", "cuda"):
        path = out / "benchmarks" / f"{device}.csv"
        begin, end = f"<!-- tpx-bench:begin {device} -->", f"<!-- tpx-bench:end {device} -->"
        if not path.is_file() or begin not in text:
            continue
        head, rest = text.split(begin, 1)
        body, tail = rest.split(end, 1)
        lines = body.split("\n")
        for i in [i for i, ln in enumerate(lines) if re.match(r"^(Quick mode\. )?Ran `", ln)][::-1]:
            del lines[i:i + 2 if i + 1 < len(lines) and not lines[i + 1] else i + 1]
        at = next((i for i, ln in enumerate(lines) if ln.startswith("Each point:")), None)
        if at is None:
            raise BenchError(f"{md}: the {device} section has no 'Each point:' paragraph")
        lines[at:at] = [ran_text_from_csv(path), ""]
        text = head + begin + "\n".join(lines) + end + tail
    md.write_text(text.rstrip("\n") + "\n")
    print(f"wrote the text of {md}")
    return 0


def datasheet_file(run):
    """The device file whose datasheet peak a run's GEMM rows are compared with."""
    name = run["big"]["device"]["name"]
    return ROOT / "tools" / "devices" / "h200.json" if "H200" in name else GPU_DEVICE_FILE


def from_logs_outputs(out, folder, first):
    """The CSV and the figure of one run of --from-logs: the first (newest) run's keep the names
    of a one-run page; an earlier run's carry its folder's name."""
    tag = "" if first else f".{folder.name}"
    return (out / "benchmarks" / f"cuda_run{tag}.csv",
            out / "figures" / f"bench_cuda_attention{tag}.svg")


def drive_from_logs(a, out):
    """--from-logs DIR [--from-logs DIR2 …]: the CUDA section, its CSV and plot from GPU runs'
    logs, newest first; runs nothing. One run: the section is that run's. Several: a table of the
    runs side by side, then one subsection per run (its own CSV and plot)."""
    import gpu_logs
    try:
        import matplotlib  # noqa: F401  (the plot; checked before anything is written)
    except ImportError:
        raise BenchError("matplotlib is missing (Debian: apt-get install python3-matplotlib; "
                         "scripts/setup.sh installs it)")
    folders = [pathlib.Path(f).resolve() for f in a.from_logs]
    try:
        runs = [gpu_logs.load_run(f) for f in folders]
    except gpu_logs.LogError as e:
        raise BenchError(str(e))
    bodies, written = [], []
    for i, (folder, run) in enumerate(zip(folders, runs)):
        # Links as docs/benchmarks.md reaches the folder, wherever --out puts the page.
        where = os.path.relpath(folder, ROOT / "docs")
        datasheet = json.loads(datasheet_file(run).read_text())["peak_bf16_flops"] / 1e12
        csv_path, figure = from_logs_outputs(out, folder, i == 0)
        bodies.append(gpu_logs.cuda_section(run, where, a.command, datasheet, csv_path,
                                            "figures/" + figure.name, latest=i == 0))
        gpu_logs.write_csv(run, csv_path)
        gpu_logs.plot_attention(run, figure)
        written += [csv_path, figure]
    if len(runs) == 1:
        body = bodies[0]
    else:
        wheres = [os.path.relpath(f, ROOT / "docs") for f in folders]
        body = gpu_logs.runs_side_by_side(runs, wheres, a.command)
        for i, (run, lines) in enumerate(zip(runs, bodies)):
            body += ["", gpu_logs.run_heading(run, latest=i == 0), ""]
            body += [("#" + ln) if ln.startswith("### ") else ln
                     for ln in lines if not ln.startswith("## ")][1:]
    md = out / "benchmarks.md"
    text = replace_section(benchmarks_md(md), "cuda", "\n".join(body))
    md.write_text(text.rstrip("\n") + "\n")
    problems = missing_outputs([md] + written)
    if problems:
        raise BenchError("the outputs are incomplete:\n  " + "\n  ".join(problems))
    print(f"wrote the cuda section of {md}, {', '.join(str(w) for w in written)} from "
          f"{', '.join(str(rel(f)) for f in folders)}")
    return 0


def drive(a):
    if a.from_logs:  # before Driver: no build, no runs
        out = pathlib.Path(a.out)
        return drive_from_logs(a, out)
    d = Driver(a)
    d.work.mkdir(parents=True, exist_ok=True)
    out = pathlib.Path(a.out)
    if a.only == "projection":  # no plots: matplotlib is not needed
        return drive_projection(a, d, out)
    if a.only == "text":
        return drive_text(out)
    try:
        import matplotlib  # noqa: F401  (checked before the runs, not after them)
    except ImportError:
        raise BenchError("matplotlib is missing (Debian: apt-get install python3-matplotlib; "
                         "scripts/setup.sh installs it)")

    if a.only in SUBSECTIONS and (a.model or a.config):
        raise BenchError(f"--only {a.only} runs {SUBSECTIONS[a.only]} on its own sizes: leave "
                         "out --model / --config")
    chosen = a.stages or STAGES
    main, wanted = parts(chosen, a.only, bool(a.model or a.config))
    cp_wanted, pp_wanted = "cp" in wanted, "pp" in wanted

    # The peak first: bench_gemm's largest GEMM, before the stages load the machine.
    gemm, chunked, gemm_cmd, gemm_note = (d.bench_gemm() if a.only != "pp" else
                                          (None, None, None, None))  # stage 09's: no MFU
    peak = measured_peak(gemm, a.device)
    peak_tflops = peak["tflops"] if peak else None
    rows, cp_rows, att = [], [], []
    if main:
        load_before = load_average()
        stages, rows, expected, skipped, refused = d.sweep(main)
        loads = (load_before, load_average())
        if not rows:  # e.g. every stage refused the --model / --config given
            why = skipped + [f"{name}: {line}" for name, line in refused.items()]
            raise BenchError("no point ran" + (": " + "; ".join(why) if why else ""))
        for name, stage in SUBSECTIONS.items():
            if stage in chosen and name not in wanted:
                skipped.append(f"`{stage}`: its subsection runs on its own sizes only, not with "
                               "--model / --config")
        add_derived(rows, peak_tflops)
    if cp_wanted:
        load_before = load_average()
        cp_rows, att, cp_expected, att_expected, cp_left = d.cp_sweep()
        cp_loads = (load_before, load_average())
        if not cp_rows and not att:
            raise BenchError(f"no point of {CP_STAGE}'s sweep ran: " + "; ".join(cp_left))
        add_derived(cp_rows, peak_tflops)
    pp_rows = []
    if pp_wanted:
        load_before = load_average()
        pp_rows, pp_expected, pp_left = d.pp_sweep()
        pp_loads = (load_before, load_average())
        if not pp_rows:
            raise BenchError(f"no point of {PP_STAGE}'s sweep ran: " + "; ".join(pp_left))

    R = Render(d, device_description(a.device, rows + cp_rows))
    md = out / "benchmarks.md"
    text = benchmarks_md(md)
    cp_block = R.cp_section(cp_rows, att, cp_left, cp_loads, peak) if cp_wanted else []
    pp_block = R.pp_section(pp_rows, pp_left, pp_loads) if pp_wanted else []
    if pp_wanted:
        write_csv(pp_rows, out / "benchmarks" / f"{a.device}_pp.csv", PP_FIELDS)
        plot_pp_bubble(pp_rows, a.device, out / "figures")
    if cp_wanted:
        write_csv(cp_rows, out / "benchmarks" / f"{a.device}_cp.csv", CP_CSV_FIELDS)
        write_csv(att, out / "benchmarks" / f"{a.device}_cp_attention.csv", ATTENTION_FIELDS)
        if att:
            plot_cp_attention(att, a.device, out / "figures")
    if main:
        collectives = d.bench_collectives()
        projection, proj_cmd, proj_note = d.projection()
        body = R.stage_section(stages, rows, skipped, refused, peak, gemm_cmd, loads)
        for block in (cp_block, pp_block):
            if block:
                body += [""] + block
        body += ["", f"### Micro-benchmarks ({a.device})", ""]
        body += R.gemm_section(gemm, chunked, gemm_cmd, gemm_note)
        body += R.collectives_section(collectives)
        check = (measured_check(d.exe("tpx_project"), GPU_DEVICE_FILE, d.work, a.timeout)
                 if projection is not None else [])
        proj = projection_section(a, d, projection, proj_cmd, proj_note, check)
        write_csv(rows, out / "benchmarks" / f"{a.device}.csv")
        plot(rows, a.device, stages, out / "figures")
        text = replace_section(text, a.device, "\n".join(body))
        text = replace_section(text, "projection", "\n".join(proj))
    else:
        for name, block in (("cp", cp_block), ("pp", pp_block)):
            if block:
                text = replace_subsection(text, a.device, name, block)
    md.write_text(text.rstrip("\n") + "\n")

    problems = []
    if main:
        problems += verify(out, a.device, expected, peak is not None, REFERENCE_STAGE in stages,
                           SECTIONS)
        wrong = [(n, op) for n, ops, _, _ in collectives if ops for op, rs in ops.items()
                 if any(r["wrong"] for r in rs)]
        for n, op in wrong:  # a benchmark program's failure: flagged in its section, not fatal
            print(f"bench: WARNING: bench_collectives: WRONG RESULTS for {op} at N={n}",
                  file=sys.stderr)
        print(f"wrote {md}, {out / 'benchmarks' / (a.device + '.csv')}, "
              f"{out / 'figures'}/bench_{a.device}_*.svg ({len(rows)} rows)")
        for note in [gemm_note, proj_note] + [c[3] for c in collectives]:
            if note:
                print(f"note: {note}")
    if cp_wanted:
        problems += verify_cp(out, a.device, cp_expected, att_expected, peak is not None)
        print(f"wrote stage 08's subsection of {md}, {out / 'benchmarks'}/{a.device}_cp*.csv, "
              f"{out / 'figures'}/bench_{a.device}_cp_attention.svg ({len(cp_rows)} + "
              f"{len(att)} rows)")
    if pp_wanted:
        problems += verify_pp(out, a.device, pp_expected)
        print(f"wrote stage 09's subsection of {md}, {out / 'benchmarks'}/{a.device}_pp.csv, "
              f"{out / 'figures'}/bench_{a.device}_pp_bubble.svg ({len(pp_rows)} rows)")
    if problems:
        raise BenchError("the outputs are incomplete:\n  " + "\n  ".join(problems))
    return 0


def parts(chosen, only, preset):
    """(the stages of the stage tables, the subsections that run: names of SUBSECTIONS) for the
    stages chosen, --only and whether --model / --config was given: stages 08 and 09 are in
    their subsections only, which run on their own sizes (--only NAME: that one alone)."""
    if only in SUBSECTIONS:
        return [], [only]
    main = [s for s in chosen if s not in SUBSECTIONS.values()]
    wanted = [] if preset else [n for n, s in SUBSECTIONS.items() if s in chosen]
    if not main and not wanted:
        raise BenchError(f"{' and '.join(SUBSECTIONS.values())} run on their own sizes only: "
                         "with --model / --config choose other stages")
    return main, wanted
