#!/usr/bin/env python3
"""Checks that every relative link in the project's markdown resolves to a file or folder.

Links are markdown's [text](target) and ![alt](target); targets with a scheme (https:, mailto:)
or only an #anchor are skipped, and an #anchor after a path is ignored. Prints each broken link
as `file:line: target` and exits 1 if there is any.

Usage: scripts/check-links.py [FILE.md ...]   (default: every tracked *.md but the build trees)
"""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*```")


def markdown_files():
    try:
        out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
        return [ROOT / f for f in out]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*.md") if not p.relative_to(ROOT).parts[0].startswith("build")]


def broken(path: pathlib.Path):
    in_code = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        if in_code:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue
            file = target.split("#", 1)[0]
            if not (path.parent / file).exists():
                yield number, target


def main():
    files = [pathlib.Path(a).resolve() for a in sys.argv[1:]] or markdown_files()
    problems = [f"{f.relative_to(ROOT)}:{n}: {t}" for f in files for n, t in broken(f)]
    for p in problems:
        print(p)
    print(f"{len(files)} markdown files, {len(problems)} broken links", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
