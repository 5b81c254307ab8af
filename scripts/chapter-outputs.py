#!/usr/bin/env python3
"""Makes the program output shown in the chapters by running the command that shows it.

A chapter marks an output block with the command that prints it, in an HTML comment on the line
before the fence (run from the repository root, after scripts/env.sh, so `mpirun -np 2` works):

    <!-- output: mpirun -np 2 build/bin/02_megatron_tp --check | sed '/layers.1/,/w_down/d' -->
    ```
    ...
    ```

A command that prints markdown (a table) is marked `<!-- output (markdown): ... -->` instead, and
its output stands unfenced, as markdown, up to a line `<!-- end of output -->`.

--fix runs every marked command and writes its output (stdout and stderr) into the block. Without
--fix it runs them and checks that each block still has the output's shape: the same lines with
every number masked, the machine a "Device:" line names masked, and runs of blanks made one
(timings, bytes and the CPU model change from machine to machine; the layout, the words and the
number of rows must not). Exits 1 on a stale block, a failing command or a marker without a
block. --build DIR runs the programs of another build tree (build/bin/ becomes DIR/bin/).

Usage: scripts/chapter-outputs.py [--fix] [--build DIR] [CHAPTER.md ...]
       (default: every stage's README.md and docs/cluster.md)
"""
import argparse
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- output( \(markdown\))?: (.+) -->$")
END = "<!-- end of output -->"
NUMBER = re.compile(r"[-+]?\d[\d,.]*(e[-+]?\d+)?")


def run(command, build):
    if build:
        command = command.replace("build/bin/", f"{build}/bin/")
    p = subprocess.run(["bash", "-c", f"source scripts/env.sh && set -o pipefail && {command}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"exit status {p.returncode}: {(p.stderr or p.stdout).strip()[-400:]}")
    return (p.stdout + p.stderr).rstrip("\n").splitlines()


# The machine a report names ("Device: cpu: <model>, 2 cores.") is the one that ran it.
DEVICE = re.compile(r"^(\s*Device: \w+:).*$")


def skeleton(lines):
    return [" ".join(NUMBER.sub("#", DEVICE.sub(r"\1 <machine>", line)).split()) for line in lines]


def first_difference(want, got):
    """The first line whose shape differs, as the chapter has it and as the program printed it."""
    for i, (w, g) in enumerate(zip(skeleton(want), skeleton(got))):
        if w != g:
            return f"  line {i + 1} of the block:\n    chapter: {want[i]}\n    now:     {got[i]}"
    return (f"  the chapter's block has {len(want)} lines, the output {len(got)}; the first extra:"
            f"\n    {(want if len(want) > len(got) else got)[min(len(want), len(got))]}")


def blocks(lines):
    """(marker line index, command, first content line, closing line) per marked block."""
    for i, line in enumerate(lines):
        m = MARKER.match(line.strip())
        if not m:
            continue
        if m.group(1):  # markdown: up to the end marker
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == END), None)
            yield i, m.group(2), i + 1, end
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            yield i, m.group(2), None, None
            continue
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        yield i, m.group(2), i + 2, end


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("chapters", nargs="*", type=pathlib.Path)
    ap.add_argument("--fix", action="store_true", help="write the outputs into the chapters")
    ap.add_argument("--build", help="the build tree whose bin/ runs (default: build)")
    a = ap.parse_args()
    chapters = a.chapters or sorted(ROOT.glob("0[1-9]_*/README.md")) + [ROOT / "docs/cluster.md"]
    problems = 0
    for chapter in chapters:
        lines = chapter.read_text().splitlines()
        rel = chapter.resolve().relative_to(ROOT)
        # Replace from the last block up, so earlier indices stay valid.
        for marker, command, first, end in reversed(list(blocks(lines))):
            where = f"{rel}:{marker + 1}"
            if first is None or end is None:
                print(f"{where}: an output marker must be followed by a fenced block (or, for "
                      f"markdown, end at a line {END})")
                problems += 1
                continue
            try:
                got = run(command, a.build)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"{where}: `{command}` failed: {e}")
                problems += 1
                continue
            if a.fix:
                lines[first:end] = got
            elif skeleton(lines[first:end]) != skeleton(got):
                print(f"{where}: the output of `{command}` has changed shape; "
                      "regenerate with scripts/chapter-outputs.py --fix")
                print(first_difference(lines[first:end], got))
                problems += 1
        if a.fix:
            chapter.write_text("\n".join(lines) + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
