#!/usr/bin/env python3
"""Checks the code the chapters quote and the lines they cite against the code.

A chapter quotes code as a reference `path:first-last` (or `path:line`) in the text right before a
fenced block whose lines start with their line number:

    The pull, `05_copy_engine_async_tp/copy_engine.cc:49-63`:

    ```
    49    bool advance() override {
     ..
    63    }
    ```

A reference since the last block must span exactly its first to its last numbered line, and
every numbered line must equal that line of the file (leading and trailing blanks aside); a line
starting " .." marks lines left out (and may say what they do).

The prose cites lines too: `path:N` or `path:N-M`, or "line N" / "lines N-M" of the file the
chapter named last. Each cited line must exist, and a reference tied to a name — "`name`
(`path:N`)", "(`name`, line N)" or "`name` at `path:N`" — must find that name (for a call or
a qualified name, its last identifier: `g->chunk_at(i)` is `chunk_at`) on the cited line, or
within the cited range. A single cited line with no name next to it says nothing the reader could
check when the code moves, so it is refused: name what is on it, or cite the name alone.

Prints each stale quote or reference as `chapter:line: ...` and exits 1 if there is any. With
--fix, a quote whose lines all still exist, moved together by one offset, is renumbered (the block
and its reference) instead. --self-test plants each kind of stale text in a scratch tree and
expects it found, and a clean chapter not reported.

Usage: scripts/check-quotes.py [--fix] [CHAPTER.md ...]   (default: the stages' */README.md)
       scripts/check-quotes.py --self-test
"""
import pathlib
import re
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = r"[\w./-]+\.(?:cc|h|cu|cuh|py|txt|cmake|sh)"
REF = re.compile(rf"`({SOURCE}):(\d+)(?:-(\d+))?`")
NUMBERED = re.compile(r"^( *)(\d+)( +(.*))?$")
# A prose reference, or a file named without lines (which "line N" then refers to).
PROSE = re.compile(rf"`(?P<path>{SOURCE})(?::(?P<a>\d+)(?:-(?P<b>\d+))?)?`"
                   r"|\blines? (?P<la>\d+)(?:[-–](?P<lb>\d+))?\b")
# The name a reference is tied to: "`name` (REF", "(`name`, REF" or "`name` at REF".
TIED = re.compile(r"(?:`([^`]+)`\s*\(\s*|\(\s*`([^`]+)`,\s*|`([^`]+)`\s+at\s+)$")
IDENT = re.compile(r"[A-Za-z_]\w*")


def resolve(root, chapter, path):
    for base in (root, chapter.parent):
        if (base / path).is_file():
            return base / path
    return None


class Quote:
    def __init__(self, root, ref, numbered):
        self.root = root
        self.path, self.first, self.last, self.ref_line = ref
        self.numbered = numbered  # (line in the chapter, match)

    def code(self):
        return (self.root / self.path).read_text().splitlines()

    def mismatches(self, chapter):
        if not (self.root / self.path).exists():
            return [f"{chapter}:{self.ref_line}: {self.path} does not exist"]
        code = self.code()
        problems = []
        for at, m in self.numbered:
            n, quoted = int(m.group(2)), (m.group(4) or "").strip()
            actual = code[n - 1].strip() if 0 < n <= len(code) else "<past the end>"
            if actual != quoted:
                problems.append(
                    f"{chapter}:{at}: {self.path}:{n} is now\n    {actual}\n  quoted as\n    {quoted}")
        return problems

    def offset(self):
        """The smallest shift that makes every quoted line match again, or None."""
        code = self.code()
        quoted = [(int(m.group(2)), (m.group(4) or "").strip()) for _, m in self.numbered]
        for d in sorted(range(-500, 501), key=abs):
            if all(0 < n + d <= len(code) and code[n + d - 1].strip() == q for n, q in quoted):
                return d
        return None

    def renumber(self, lines, d):
        for at, m in self.numbered:
            lead, digits, rest = m.group(1), m.group(2), m.group(3) or ""
            n = str(int(digits) + d)
            if lead:  # right-aligned numbers: keep the column where they end
                lines[at - 1] = n.rjust(len(lead) + len(digits)) + rest
            else:  # left-aligned: keep the column where the code starts
                code = rest.lstrip(" ")
                lines[at - 1] = n.ljust(len(digits) + len(rest) - len(code)) + code if code else n
        span = lambda a, b: f"`{self.path}:{a}-{b}`" if a != b else f"`{self.path}:{a}`"
        lines[self.ref_line - 1] = lines[self.ref_line - 1].replace(
            span(self.first, self.last), span(self.first + d, self.last + d))


def quotes(root, lines):
    """Yields the numbered quotes of a chapter, or a string for a quote with no reference."""
    refs = []  # (path, first, last, line of the reference) since the last block
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            for path, first, last in REF.findall(lines[i]):
                refs.append((path, int(first), int(last or first), i + 1))
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        block = [(k + 1, lines[k]) for k in range(i + 1, j)]
        numbered = [(at, m) for at, text in block if (m := NUMBERED.match(text))]
        if numbered and all(NUMBERED.match(t) or t.strip().startswith("..") for _, t in block):
            numbers = [int(m.group(2)) for _, m in numbered]
            first, last = min(numbers), max(numbers)
            spanning = [r for r in refs if r[1:3] == (first, last)]
            if spanning:
                yield Quote(root, spanning[-1], numbered)
            else:
                yield (f"{i + 1}: no `file:first-last` before this quote spans its lines "
                       f"{first}-{last}" + (f" (the nearest: `{refs[-1][0]}:{refs[-1][1]}-"
                                            f"{refs[-1][2]}`, line {refs[-1][3]})" if refs else ""))
        refs = []
        i = j + 1


def prose(root, chapter, lines, quoted):
    """The stale references of the prose (those of `quoted`, (chapter line, path), aside)."""
    problems = []
    last_path = None
    paragraph = []  # (chapter line, text)

    def flush():
        nonlocal last_path
        text, starts = "", []
        for at, line in paragraph:
            starts.append((len(text), at))
            text += line + " "
        for m in PROSE.finditer(text):
            at = max(a for s, a in starts if s <= m.start())
            if m.group("path") and m.group("a") is None:
                last_path = m.group("path")
                continue
            path = m.group("path") or last_path
            a = int(m.group("a") or m.group("la"))
            b = int(m.group("b") or m.group("lb") or a)
            if m.group("path"):
                last_path = path
                if (at, path, a) in quoted:
                    continue
            where = f"{chapter}:{at}: {m.group(0)}"
            if path is None:
                problems.append(f"{where} cites a line of no file: name the file")
                continue
            file = resolve(root, chapter, path)
            if file is None:
                problems.append(f"{where}: {path} does not exist")
                continue
            code = file.read_text().splitlines()
            if not 0 < a <= b <= len(code):
                problems.append(f"{where}: {path} has {len(code)} lines")
                continue
            tied = TIED.search(text[:m.start()])
            if not tied:
                if a == b:
                    problems.append(f"{where}: a single line with no `name` next to it; name what "
                                    f"is on {path}:{a}, or cite the name alone")
                continue
            name = next(g for g in tied.groups() if g)
            if PROSE.fullmatch(f"`{name}`"):  # a file, not a name: "`path:N-M` (lines …)"
                continue
            idents = IDENT.findall(name.split("(", 1)[0]) or IDENT.findall(name)
            if not idents:
                continue
            ident = idents[-1]
            if not any(re.search(rf"\b{ident}\b", code[n - 1]) for n in range(a, b + 1)):
                found = [n + 1 for n, line in enumerate(code) if re.search(rf"\b{ident}\b", line)]
                problems.append(f"{where}: `{ident}` is not on {path}:{a}" + (f"-{b}" if b != a else "")
                                + (f" (it is on line {', '.join(map(str, found[:4]))})" if found else ""))
        paragraph.clear()

    fenced = False
    for at, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            flush()
            continue
        if fenced:
            continue
        if not line.strip() or line.startswith("#"):
            flush()
        else:
            paragraph.append((at, line))
    flush()
    return problems


def check(chapter, fix, root=ROOT):
    lines = chapter.read_text().splitlines()
    problems, fixed, quoted = [], False, set()
    for q in list(quotes(root, lines)):
        if isinstance(q, str):
            problems.append(f"{chapter}:{q}")
            continue
        quoted.add((q.ref_line, q.path, q.first))
        found = q.mismatches(chapter)
        d = q.offset() if found and fix else None
        if d is None:
            problems += found
        else:
            q.renumber(lines, d)
            fixed = True
            print(f"{chapter}:{q.ref_line}: renumbered {q.path}:{q.first}-{q.last} by {d:+d}")
    if fixed:
        chapter.write_text("\n".join(lines) + "\n")
    return problems + prose(root, chapter, lines, quoted)


SELF_TEST_CODE = """\
int helper() { return 1; }

int twice(int x) {
  const int y = helper();
  return 2 * x * y;
}
"""

SELF_TEST_CHAPTERS = {
    # Each planted chapter holds exactly one stale thing; "clean" holds every form, right.
    "clean": "`twice` (`src/a.cc:3-6`) calls `helper` (`src/a.cc:1`); it is named on its first\n"
             "line (`twice`, line 3), and `helper()` at `src/a.cc:4`. The whole of it,\n"
             "`src/a.cc:3-6`:\n\n```cpp\n3 int twice(int x) {\n ..\n6 }\n```\n\n"
             "The call (`helper`, line 4) and the lines around it (lines 3-5). `src/a.cc:1-6`\n"
             "(lines 3-6, the function).\n",
    "stale quote": "`src/a.cc:3-4`:\n\n```cpp\n3 int twice(int x) {\n4   return 2 * x;\n```\n",
    "reference not spanning its quote": "The function, `src/a.cc:3-6`, and its body, `src/a.cc:2-5`:\n\n"
                                        "```cpp\n4   const int y = helper();\n5   return 2 * x * y;\n```\n",
    "name off its line": "`twice` (`src/a.cc:1`) doubles.\n",
    "bare line off its name": "In `src/a.cc`, the call (`helper`, line 3).\n",
    "single line without a name": "The call is at `src/a.cc:4`.\n",
    "line past the end": "`src/a.cc` ends before (`twice`, lines 3-9).\n",
    "missing file": "`twice` (`src/b.cc:3`)\n",
}


def self_test():
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        (root / "src").mkdir()
        (root / "src/a.cc").write_text(SELF_TEST_CODE)
        ok = True
        for name, text in SELF_TEST_CHAPTERS.items():
            chapter = root / (name.replace(" ", "_") + ".md")
            chapter.write_text(text)
            found = check(chapter, False, root)
            if name == "clean" and found:
                print(f"self-test: the clean chapter was reported: {found}")
                ok = False
            elif name != "clean" and len(found) != 1:
                print(f"self-test: {name}: expected one problem, found {found}")
                ok = False
    print("self-test:", "every planted stale reference found, the clean chapter not reported"
          if ok else "FAILED")
    return ok


def main():
    args = sys.argv[1:]
    if args == ["--self-test"]:
        return 0 if self_test() else 1
    fix = "--fix" in args
    chapters = [pathlib.Path(a) for a in args if a != "--fix"]
    chapters = chapters or sorted(ROOT.glob("[0-9][0-9]_*/README.md"))
    problems = [p for c in chapters for p in check(c, fix)]
    for p in problems:
        print(p)
    print(f"{len(chapters)} chapters, {len(problems)} stale quoted or cited lines", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
