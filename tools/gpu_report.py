#!/usr/bin/env python3
"""Writes the step table of a GPU run into docs/gpu-validation.md, from the run's own reports.

scripts/gpu-validate.sh leaves, per part it ran, a report.md (date, device, commit, one row per
step) and logs/. A run published under docs/gpu-runs/<run>/ keeps them as logs/report-<part>.md
and logs/<part>/logs/*.log. This script reads every report of one run and replaces the block
between `<!-- tpx-gpu:begin steps -->` and `<!-- tpx-gpu:end steps -->` of the page with: the
device, driver, date and commit the reports name, and one table of every step (part, step,
result, seconds, log, linked). A part that ran without a report kept (its logs only) is listed
from its logs, each marked as such, with the line that ended it where the program aborted.
No result in the table is typed by hand.

  tools/gpu_report.py RUN_DIR [--page docs/gpu-validation.md] [--check]

--check compares instead of writing: exit 1 (and the first differing line) when the page's block
is not what the run's reports give.
"""
import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- tpx-gpu:begin steps -->", "<!-- tpx-gpu:end steps -->"
ROW = re.compile(r"^\| (\d+) \| ([^|]+) \| ([^|]+) \| (\d+) \| .* \| ([^|]+) \|$")
ORDER = ["facts", "unit", "sanitize", "san", "stages", "big", "bench", "profile"]
HEAD = re.compile(r"^- (date|device|commit|build): (.*)$")


class ReportError(Exception):
    pass


def read_report(path):
    """The header fields and the step rows of one gpu-validate.sh report.md."""
    head, rows = {}, []
    for line in path.read_text().splitlines():
        if m := HEAD.match(line):
            head[m.group(1)] = m.group(2).replace("(name, driver, compute mode)", "").strip()
        elif m := ROW.match(line):
            rows.append({"n": int(m.group(1)), "step": m.group(2).strip(),
                         "result": m.group(3).strip(), "seconds": int(m.group(4)),
                         "log": m.group(5).strip()})
    for key in ("date", "device", "commit"):
        if key not in head:
            raise ReportError(f"{path}: no '- {key}:' line")
    if not rows:
        raise ReportError(f"{path}: no step rows")
    return head, rows


def abort_line(log, width=110):
    """The message of a program that threw or aborted (its middle cut to `width`), or None."""
    for line in log.read_text(errors="replace").splitlines():
        if "what():" in line or "Aborted" in line:
            why = line.split("what():", 1)[-1].strip()
            return why if len(why) <= width else f"{why[:45]} … {why[-(width - 48):]}"
    return None


def parts_of(run):
    """[(part, header or None, rows)] in the order the run's parts ran (by their first date)."""
    logs = run / "logs"
    if not logs.is_dir():
        raise ReportError(f"{run}: no logs/ folder")
    parts = []
    def order(p):  # gpu-validate.sh's order of its parts; others after them, by name
        return (ORDER.index(p.name) if p.name in ORDER else len(ORDER), p.name)

    for part_dir in sorted((p for p in logs.iterdir() if p.is_dir()), key=order):
        part = part_dir.name
        report = logs / f"report-{part}.md"
        if not report.exists():
            report = part_dir / "report.md"
        if report.exists():
            head, rows = read_report(report)
        else:
            head, rows = None, []
            for i, log in enumerate(sorted((part_dir / "logs").glob("*.log")), 1):
                why = abort_line(log)
                rows.append({"n": i, "step": re.sub(r"^\d+-|\.log$", "", log.name),
                             "result": f"aborted: `{why}`" if why else "ran (no report kept)",
                             "seconds": None, "log": log.name})
        for r in rows:
            r["path"] = (part_dir / "logs" / r["log"]).relative_to(ROOT / "docs")
        parts.append((part, head, rows))
    if not parts:
        raise ReportError(f"{run}/logs: no parts")
    return parts


def block(run):
    parts = parts_of(run)
    heads = [h for _, h, _ in parts if h]
    devices = sorted({h["device"] for h in heads})
    commits = sorted({h["commit"] for h in heads})
    dates = sorted(h["date"] for h in heads)
    total = sum(len(rows) for _, _, rows in parts)
    failed = [(p, r) for p, _, rows in parts for r in rows
              if r["result"].startswith(("FAIL", "aborted"))]
    out = [BEGIN,
           f"Written by `tools/gpu_report.py {run.relative_to(ROOT)}` from the run's reports; "
           "not typed by hand.", "",
           f"- device: {'; '.join(devices)} (name, driver, compute mode)",
           f"- commit (as the reports name it): {', '.join(commits)}",
           f"- date: {dates[0]} to {dates[-1]}" if dates else "- date: unknown",
           f"- steps: {total}, of which {total - len(failed)} passed or ran and {len(failed)} "
           "failed", "",
           "| part | # | step | result | seconds | log |", "|---|---|---|---|---|---|"]
    for part, _, rows in parts:
        for r in rows:
            seconds = "—" if r["seconds"] is None else str(r["seconds"])
            out.append(f"| {part} | {r['n']} | {r['step']} | {r['result']} | {seconds} | "
                       f"[{r['log']}]({r['path']}) |")
    out.append(END)
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a published run, e.g. docs/gpu-runs/2026-11-27-h100")
    ap.add_argument("--page", type=Path, default=ROOT / "docs" / "gpu-validation.md")
    ap.add_argument("--check", action="store_true", help="compare, do not write")
    a = ap.parse_args(argv)
    try:
        new = block(a.run.resolve())
    except ReportError as e:
        print(f"gpu_report: {e}", file=sys.stderr)
        return 2
    text = a.page.read_text()
    if BEGIN not in text or END not in text:
        print(f"gpu_report: {a.page} has no {BEGIN} … {END} block", file=sys.stderr)
        return 2
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    if a.check:
        old = text[start:stop]
        if old == new:
            print(f"gpu_report: {a.page}'s step table matches {a.run}")
            return 0
        for i, (x, y) in enumerate(zip(old.splitlines() + [""] * 999, new.splitlines()), 1):
            if x != y:
                print(f"gpu_report: {a.page} differs from the run's reports at block line {i}:\n"
                      f"  page: {x}\n  run:  {y}\nrun tools/gpu_report.py {a.run} to rewrite it")
                return 1
        return 1
    a.page.write_text(text[:start] + new + text[stop:])
    print(f"gpu_report: wrote the step table of {a.run} into {a.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
