#!/usr/bin/env python3
"""Checks that every relative link in the project's markdown resolves to a file or folder, and
that every file the prose names exists.

Links are markdown's [text](target) and ![alt](target); targets with a scheme (https:, mailto:)
or only an #anchor are skipped, and an #anchor after a path is ignored.

Named files are the prose's mentions of a source or page, in backticks or not: a bare name
(`DESIGN.md`, `layers.cc`) must be some file of the project (any folder), a path whose first
folder is one of the project's (`common/ring.cc`, `tools/bench.py`) must be that file, from the
page's folder or from the top. Paths under other folders are another project's (Megatron's
`megatron/core/…`) or a run's (`out/…`), and what a run writes (.json, .csv, .svg) is not named
here, so neither is checked. Code blocks and URLs are skipped.

Prints each broken link or missing file as `file:line: target` and exits 1 if there is any.
--self-test plants each kind in a scratch tree and expects it found, and a clean page not reported.

Usage: scripts/check-links.py [FILE.md ...]   (default: every tracked *.md but the build trees)
       scripts/check-links.py --self-test
"""
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*```")
URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://\S+")
NAMED = re.compile(r"(?<![\w./:~$-])((?:[\w.-]+/)*[\w-][\w.-]*\.(?:md|cc|h|cu|cuh|py|sh|cmake))"
                   r"(?![\w/-])")


def project_files(root):
    try:
        out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.split()
        if out:
            return out
    except (OSError, subprocess.CalledProcessError):
        pass
    return [str(p.relative_to(root)) for p in root.rglob("*")
            if p.is_file() and not p.relative_to(root).parts[0].startswith(("build", ".git"))]


def broken(path: pathlib.Path, root, files):
    folders = {f.split("/", 1)[0] for f in files if "/" in f}
    names = {f.rsplit("/", 1)[-1] for f in files}
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
        prose = URL.sub(" ", LINK.sub(lambda m: m.group(0).split("](", 1)[0], line))
        for name in NAMED.findall(prose):
            if "/" not in name:
                if name not in names:
                    yield number, f"{name} (named, and no file of the project has that name)"
            elif name.split("/", 1)[0] in folders:
                if not ((path.parent / name).exists() or (root / name).exists()):
                    yield number, f"{name} (named, and no such file)"


def check(files, root=ROOT):
    known = project_files(root)
    return [f"{f.relative_to(root)}:{n}: {t}" for f in files for n, t in broken(f, root, known)]


SELF_TEST_PAGES = {
    "clean.md": "See [the other page](sub/other.md), `sub/code.cc` and code.cc, README.md's\n"
                "neighbour, Megatron's `megatron/core/attention.py`, a run's `out/r.json`, and\n"
                "https://example.org/DESIGN.md.\n\n```\nmissing.cc in a code block\n```\n",
    "link.md": "A [link](sub/nowhere.md).\n",
    "bare.md": "The recipe of DESIGN.md, \"Mixed precision\".\n",
    "path.md": "The layer, `sub/layers.cc`.\n",
}


def self_test():
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        (root / "sub").mkdir()
        for name in ("sub/other.md", "sub/code.cc", "README.md"):
            (root / name).write_text("x\n")
        for name, text in SELF_TEST_PAGES.items():
            (root / name).write_text(text)
        ok = True
        for name in SELF_TEST_PAGES:
            found = check([root / name], root)
            if (name == "clean.md") != (not found) or len(found) > 1:
                print(f"self-test: {name}: {found or 'nothing found'}")
                ok = False
    print("self-test:", "every planted broken link and missing file found, the clean page not "
          "reported" if ok else "FAILED")
    return ok


def main():
    if sys.argv[1:] == ["--self-test"]:
        return 0 if self_test() else 1
    files = [pathlib.Path(a).resolve() for a in sys.argv[1:]]
    if not files:
        files = [ROOT / f for f in project_files(ROOT) if f.endswith(".md")]
    problems = check(files)
    for p in problems:
        print(p)
    print(f"{len(files)} markdown files, {len(problems)} broken links or missing files",
          file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
