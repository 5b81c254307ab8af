#!/usr/bin/env python3
"""Checks the code quoted in the chapters against the code.

A chapter quotes code as a reference `path:first-last` (or `path:line`) in the text before a
fenced block whose lines start with their line number (of the references since the last block,
the one whose range holds the quoted numbers):

    The pull, `05_copy_engine_async_tp/copy_engine.cc:49-63`:

    ```
    49    bool advance() override {
     ..
    63    }
    ```

Every numbered line must equal that line of the file (leading and trailing blanks aside), and
a line starting " .." marks lines left out (and may say what they do). Prints each stale quote as `chapter:line: ...` and exits 1 if there is
any. With --fix, a quote whose lines all still exist, moved together by one offset, is renumbered
(the block and its reference) instead.

Usage: scripts/check-quotes.py [--fix] [CHAPTER.md ...]   (default: the stages' */README.md)
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
REF = re.compile(r"`([\w./-]+\.(?:cc|h|cu|cuh|py|txt|cmake)):(\d+)(?:-(\d+))?`")
NUMBERED = re.compile(r"^( *)(\d+)( +(.*))?$")


class Quote:
    def __init__(self, ref, numbered):
        self.path, self.first, self.last, self.ref_line = ref
        self.numbered = numbered  # (line in the chapter, match)

    def code(self):
        return (ROOT / self.path).read_text().splitlines()

    def mismatches(self, chapter):
        if not (ROOT / self.path).exists():
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


def quotes(lines):
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
            holding = [r for r in refs if r[1] <= min(numbers) and max(numbers) <= r[2]]
            if holding:
                yield Quote(holding[0], numbered)
            else:
                yield (f"{i + 1}: no `file:first-last` before this quote holds its lines "
                       f"{min(numbers)}-{max(numbers)}")
        refs = []
        i = j + 1


def check(chapter, fix):
    lines = chapter.read_text().splitlines()
    problems, fixed = [], False
    for q in list(quotes(lines)):
        if isinstance(q, str):
            problems.append(f"{chapter}:{q}")
            continue
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
    return problems


def main():
    args = sys.argv[1:]
    fix = "--fix" in args
    chapters = [pathlib.Path(a) for a in args if a != "--fix"]
    chapters = chapters or sorted(ROOT.glob("[0-9][0-9]_*/README.md"))
    problems = [p for c in chapters for p in check(c, fix)]
    for p in problems:
        print(p)
    print(f"{len(chapters)} chapters, {len(problems)} stale quoted lines", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
