#!/usr/bin/env python3
"""Makes the chapters' run figures (timelines, signals, losses) again, from real runs.

A chapter marks such a figure with the command that makes it, in an HTML comment on the line
before the image (run from the repository root after scripts/env.sh, so `mpirun -np 2` works):

    <!-- figure: mpirun -np 2 build/bin/04_overlap_ring --steps 3 --trace /tmp/t04.json >/dev/null && python3 tools/trace_svg.py /tmp/t04.json ... -o docs/figures/04_timeline_np2.svg -->
    ![...](../docs/figures/04_timeline_np2.svg)

The command runs the program and draws the figure; every `/tmp/` in it becomes a private
scratch directory and `docs/figures/` the output directory, so a check never touches the
committed files.

Without --fix or --out it makes every figure into scratch and checks that each command succeeds,
writes the figure the image shows, and that the new figure is the same figure: its SVG <title>
(which names the stage, ranks, backend and window) equals the committed one's. Timings differ
from run to run, so the spans themselves are not compared. Exits 1 on a failing command, a
missing figure, a changed title, or an image of a run figure (a timeline, signals or loss plot
in docs/figures/) that has no marker. --fix writes the figures into docs/figures/; --out DIR
writes them into DIR (the docs target: the site's figures come from this build's programs).
--build DIR runs the programs of another build tree (build/bin/ becomes DIR/bin/).

Usage: scripts/chapter-figures.py [--fix | --out DIR] [--build DIR] [CHAPTER.md ...]
       (default: every stage's README.md and docs/checkpoints.md)
"""
import argparse
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- figure: (.+) -->$")
# A chapter's image (../docs/figures/) or a docs page's (figures/).
IMAGE = re.compile(r"!\[[^\]]*\]\((?:\.\./docs/)?figures/([^)]+\.svg)\)")
RUN_FIGURE = re.compile(r"(timeline|signals|column_backward|loss|memory)")  # figures made from runs
TITLE = re.compile(r"<title>(.*?)</title>", re.S)


def title(path):
    m = TITLE.search(pathlib.Path(path).read_text(encoding="utf-8"))
    return m.group(1).strip() if m else None


def figures(lines):
    """(line number, command, figure file name or None) per marker; images without one."""
    marked, unmarked = [], []
    for i, line in enumerate(lines):
        m = MARKER.match(line.strip())
        if m:
            img = IMAGE.search(lines[i + 1]) if i + 1 < len(lines) else None
            marked.append((i + 1, m.group(1), img.group(1) if img else None))
            continue
        img = IMAGE.search(line)
        if img and RUN_FIGURE.search(img.group(1)) and not (i and MARKER.match(lines[i - 1].strip())):
            unmarked.append((i + 1, img.group(1)))
    return marked, unmarked


def run(command, build, out_dir, scratch):
    # The command's own paths first: the build tree may itself lie under /tmp/.
    command = command.replace("/tmp/", f"{scratch}/").replace("docs/figures/", f"{out_dir}/")
    if build:
        command = command.replace("build/bin/", f"{build}/bin/")
    p = subprocess.run(["bash", "-c", f"source scripts/env.sh && set -o pipefail && {command}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"exit status {p.returncode}: {(p.stderr or p.stdout).strip()[-400:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("chapters", nargs="*", type=pathlib.Path)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--fix", action="store_true", help="write the figures into docs/figures/")
    mode.add_argument("--out", type=pathlib.Path, help="write the figures into this directory")
    ap.add_argument("--build", help="the build tree whose bin/ runs (default: build)")
    a = ap.parse_args()
    chapters = a.chapters or (sorted(ROOT.glob("0[1-9]_*/README.md")) +
                              [ROOT / "docs" / "checkpoints.md"])
    committed = ROOT / "docs" / "figures"
    problems = 0
    with tempfile.TemporaryDirectory(prefix="tpx-figures-") as tmp:
        tmp = pathlib.Path(tmp)
        out_dir = committed if a.fix else (a.out.resolve() if a.out else tmp / "out")
        out_dir.mkdir(parents=True, exist_ok=True)
        for chapter in chapters:
            rel = chapter.resolve().relative_to(ROOT)
            marked, unmarked = figures(chapter.read_text(encoding="utf-8").splitlines())
            for line, name in unmarked:
                print(f"{rel}:{line}: figure {name} is drawn from a run but has no "
                      "'<!-- figure: ... -->' marker with the command that makes it")
                problems += 1
            for line, command, name in marked:
                where = f"{rel}:{line}"
                if name is None:
                    print(f"{where}: a figure marker must be followed by its image line")
                    problems += 1
                    continue
                if f"docs/figures/{name}" not in command:
                    print(f"{where}: the command does not write docs/figures/{name}")
                    problems += 1
                    continue
                scratch = tmp / f"scratch-{line}"
                scratch.mkdir()
                try:
                    run(command, a.build, out_dir, scratch)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    print(f"{where}: the command for {name} failed: {e}")
                    problems += 1
                    continue
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
                made = out_dir / name
                if not made.exists():
                    print(f"{where}: the command ran but wrote no {name}")
                    problems += 1
                elif not a.fix and (committed / name).exists() and \
                        title(made) != title(committed / name):
                    print(f"{where}: {name} is another figure now: title '{title(made)}', "
                          f"committed '{title(committed / name)}' (regenerate with --fix)")
                    problems += 1
                else:
                    print(f"{where}: {name} made from a run")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
