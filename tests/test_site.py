#!/usr/bin/env python3
"""Checks the tutorial as its readers see it: on the site in a real browser, and on GitHub.

  test_site.py browser HTML_DIR [--screenshots DIR]
      Serves HTML_DIR (the docs target's html/) on its own, as any host would, opens every page of
      the reading order (docs/toc.txt) in headless Chromium at 1280 px and fails on: raw markup
      or stray backticks in the prose (markdown Doxygen did not understand), a display formula
      MathJax did not typeset, an image that does not load or is wider than the window, a
      relative link that leads nowhere (a missing file, or an #anchor missing from its page), a
      code span showing the backslash of a pipe escaped for a markdown table,
      a sidebar tree that does not list the pages in reading order, or a page without its link
      to the next one. Every in-page #anchor of every html file is checked too. With
      --screenshots it saves the top of each page there as a PNG for a person to look at.
  test_site.py github
      Renders every page of the reading order with cmark-gfm (GitHub's CommonMark) and fails on
      stray backticks or raw markup in the prose, and on a fenced block that names no language.

Exits 77 (ctest: skipped), with the reason, when Chromium, chromedriver or selenium (browser) or
cmark-gfm (github) is not installed; scripts/setup.sh installs them all.
"""
import argparse
import functools
import html.parser
import http.server
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
SKIP = 77
_spec = importlib.util.spec_from_file_location("site", ROOT / "docs" / "site.py")
site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(site)

# Pages whose reader comes for one thing first: its first and last sections (the markdown's ##,
# Doxygen's h1 inside the page), as the site shows them. The benchmarks lead with tpx against
# PyTorch on a GPU; the method comes last.
SECTION_ORDER = {"docs/benchmarks.md": ("CUDA", "How this page is made")}

# Text the reader should never see in prose: markup that reached the page as text, Doxygen
# commands, a `--flag` whose code span was lost (Doxygen turns its -- into an en dash) and a
# quotation Doxygen made of a code span with an apostrophe in it.
RAW = [
    (re.compile(r"</?(td|tr|th|tt|table|code|div|span|img|a|p|br|em|b)\b[^>]*>", re.I), "raw HTML"),
    (re.compile(r"\\(ilinebr|ref|f\[|f\]|f\$|image)\b|@ref\b"), "a Doxygen command"),
    (re.compile(r"(^|\s)–[a-z]"), "a --flag turned into an en dash"),
    (re.compile(r"‘"), "a quotation made of a code span"),
    (re.compile(r"`"), "a stray backtick"),
    (re.compile(r"\]\(|!\["), "markdown link syntax"),
]


def prose_problems(where, text):
    out = []
    for pattern, what in RAW:
        for m in pattern.finditer(text):
            s = max(0, m.start() - 50)
            out.append(f"{where}: {what} in the prose: …{text[s:m.end() + 50]}…".replace("\n", " "))
    return out


def pages():
    return [(p.relative_to(ROOT).as_posix(), site.page_id(p) + ".html") for p in site.reading_order()]


# --- github ---------------------------------------------------------------------------------


class ProseText(html.parser.HTMLParser):
    """The text of rendered HTML outside code, pre and math."""
    SKIPPED = {"code", "pre", "script", "style", "math"}

    def __init__(self):
        super().__init__()
        self.depth, self.parts = 0, []

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIPPED:
            self.depth += 1

    def handle_endtag(self, tag):
        if tag in self.SKIPPED and self.depth:
            self.depth -= 1

    def handle_data(self, data):
        if not self.depth:
            self.parts.append(data)


def github():
    cmark = shutil.which("cmark-gfm")
    if not cmark:
        print("SKIP: cmark-gfm is not installed (scripts/setup.sh installs it)")
        return SKIP
    problems = []
    for rel, _ in pages():
        text = (ROOT / rel).read_text()
        fence = None
        for n, line in enumerate(text.splitlines(), 1):
            if line.lstrip().startswith("```"):
                if fence is None and not line.strip()[3:].strip():
                    problems.append(f"{rel}:{n}: a fenced block without its language (```cpp, "
                                    "```sh, ```text, ```math)")
                fence = None if fence else line
        rendered = subprocess.run([cmark, "--unsafe", "-e", "table", "-e", "autolink",
                                   "-e", "strikethrough"], input=text, capture_output=True,
                                  text=True, check=True).stdout
        parser = ProseText()
        parser.feed(rendered)
        # Raw HTML the chapter writes on purpose (comments, <sub>) is markup here, not text;
        # what is left must read as prose.
        problems += [p for p in prose_problems(rel, "".join(parser.parts))
                     if "en dash" not in p and "quotation" not in p]
    for p in problems:
        print(p)
    print(f"github: {len(pages())} pages rendered with cmark-gfm, {len(problems)} problems")
    return 1 if problems else 0


# --- browser --------------------------------------------------------------------------------

# Runs in the page: the prose's text (outside code, formulas, scripts), the images, the links,
# the sidebar tree and the previous / next links.
INSPECT = r"""
const skip = 'pre, code, .fragment, script, style, .MathJax, .MathJax_Display, .MathJax_Preview, '
           + '.formulaDsp, #nav-tree, #MSearchBox, #MSearchSelectWindow, #MSearchResultsWindow';
const walker = document.createTreeWalker(document.querySelector('div.contents') || document.body,
                                         NodeFilter.SHOW_TEXT);
const prose = [];
while (walker.nextNode()) {
  const n = walker.currentNode;
  if (!n.parentElement.closest(skip)) prose.push(n.textContent);
}
const width = document.documentElement.clientWidth;
const images = [...document.querySelectorAll('div.contents img')].map(img => {
  const r = img.getBoundingClientRect();
  return {src: img.getAttribute('src'), loaded: img.complete && img.naturalWidth > 0,
          left: r.left, right: r.right};
});
const links = [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href'));
// A pipe escaped for a markdown table inside a code span: GitHub drops the backslash, Doxygen
// shows it.
const escaped = [...document.querySelectorAll('div.contents code')].map(c => c.textContent)
                    .filter(t => t.includes('\\|'));
const tree = [...document.querySelectorAll('#nav-tree a[href]')].map(a => a.getAttribute('href'));
const sections = [...document.querySelectorAll('div.contents h1')].map(h => h.textContent.trim());
const next = document.querySelector('div.tpx-pager .tpx-next a[href]');
const prev = document.querySelector('div.tpx-pager .tpx-prev a[href]');
return {prose: prose.join(''), width: width, images: images, links: links, tree: tree,
        escaped: escaped, sections: sections,
        next: next && next.getAttribute('href'), prev: prev && prev.getAttribute('href'),
        formulas: document.querySelectorAll('.formulaDsp').length,
        typeset: document.querySelectorAll('.formulaDsp .MathJax_Display, .formulaDsp .MathJax').length,
        math_errors: document.querySelectorAll('.MathJax_Error, [data-mjx-error]').length};
"""

# Waits until MathJax, where the page loads it, has started and typeset everything queued.
MATHJAX_DONE = r"""
const done = arguments[arguments.length - 1];
if (!document.querySelector('script[src$="MathJax.js"]')) { done(false); return; }
(function wait() {
  if (window.MathJax && MathJax.isReady) MathJax.Hub.Queue(() => done(true));
  else setTimeout(wait, 50);
})();
"""


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # the browser closing a connection early is not the site's fault


def serve(directory):
    server = Server(("127.0.0.1", 0),
                                             functools.partial(Quiet, directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def anchors_of(path, cache={}):
    if path not in cache:
        text = path.read_text(errors="replace") if path.is_file() else ""
        cache[path] = set(re.findall(r'\b(?:id|name)="([^"]+)"', text))
    return cache[path]


def in_page_anchors(html_dir):
    """Every href="#x" of every html file must have its id or name in the same file."""
    problems = []
    for f in sorted(html_dir.glob("*.html")):
        for anchor in set(re.findall(r'href="#([^"]+)"', f.read_text(errors="replace"))):
            if anchor not in anchors_of(f):
                problems.append(f"{f.name}: #{anchor} points nowhere in the page")
    return problems


def link_problems(html_dir, base, page, links, checked):
    problems = []
    for href in links:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", href) or href.startswith("#") or not href:
            continue
        url = urllib.parse.urljoin(base + page, href)
        target, _, anchor = url.partition("#")
        if target not in checked:
            try:
                with urllib.request.urlopen(target, timeout=10) as r:
                    checked[target] = r.status == 200
            except (urllib.error.URLError, OSError):
                checked[target] = False
        if not checked[target]:
            problems.append(f"{page}: the link {href} leads nowhere (served alone, {target} is "
                            "missing)")
        elif anchor and target.endswith(".html"):
            local = html_dir / urllib.parse.unquote(target[len(base):])
            if anchor not in anchors_of(local):
                problems.append(f"{page}: the link {href}: no #{anchor} in {local.name}")
    return problems


def browser(html_dir, screenshots):
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
        from selenium.common.exceptions import TimeoutException
    except ImportError:
        print(f"SKIP: python3-selenium is not installed for {sys.executable} "
              "(scripts/setup.sh installs it)")
        return SKIP
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_exe = shutil.which("chromedriver")
    if not chromium or not driver_exe:
        print("SKIP: chromium or chromium-driver is not installed (scripts/setup.sh installs them)")
        return SKIP
    if not (html_dir / "index.html").is_file():
        print(f"{html_dir}/index.html does not exist: build the docs target first")
        return 1

    problems = in_page_anchors(html_dir)
    order = pages()
    server, base = serve(html_dir)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--hide-scrollbars", "--window-size=1280,900"):
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(driver_exe), options=options)
    except Exception as e:  # the browser is installed but cannot start here
        print(f"chromium did not start: {e}")
        return 1
    if screenshots:
        screenshots.mkdir(parents=True, exist_ok=True)
    checked = {}
    try:
        driver.set_script_timeout(30)
        for i, (rel, page) in enumerate(order):
            driver.get(base + page)
            where = f"{page} ({rel})"
            try:
                driver.execute_async_script(MATHJAX_DONE)
            except TimeoutException:
                problems.append(f"{where}: MathJax did not finish within 30 s")
            got = driver.execute_script(INSPECT)
            problems += prose_problems(where, got["prose"])
            problems += [f"{where}: a backslash before a pipe in code, `{code}` (write the "
                         "alternatives outside the code span)" for code in got["escaped"]]
            if got["formulas"] and (got["typeset"] < got["formulas"] or got["math_errors"]):
                problems.append(f"{where}: {got['formulas']} display formulas, "
                                f"{got['typeset']} typeset by MathJax, {got['math_errors']} errors")
            for img in got["images"]:
                if not img["loaded"]:
                    problems.append(f"{where}: the image {img['src']} does not load")
                elif img["right"] > got["width"] + 0.5 or img["left"] < 0:
                    problems.append(f"{where}: the image {img['src']} spans {img['left']:.0f} .. "
                                    f"{img['right']:.0f} px, wider than the {got['width']} px window")
            problems += link_problems(html_dir, base, page, got["links"], checked)
            # The tree's pages, in order, without the root's repeat of the front page.
            tree = []
            for h in got["tree"]:
                h = h.split("#")[0]
                if h.endswith(".html") and h not in tree:
                    tree.append(h)
            wanted = [p for _, p in order]
            if tree[:len(wanted)] != wanted:
                problems.append(f"{where}: the sidebar tree does not list the tutorial first, in "
                                f"reading order: {tree[:len(wanted) + 2]}")
            if i + 1 < len(order) and got["next"] != order[i + 1][1]:
                problems.append(f"{where}: no link to the next page, {order[i + 1][1]} "
                                f"(found {got['next']})")
            if i > 0 and got["prev"] != order[i - 1][1]:
                problems.append(f"{where}: no link to the previous page, {order[i - 1][1]} "
                                f"(found {got['prev']})")
            if rel in SECTION_ORDER:
                first, last = SECTION_ORDER[rel]
                got_sections = got["sections"]
                if not got_sections or not got_sections[0].startswith(first) or \
                        not got_sections[-1].startswith(last):
                    problems.append(f"{where}: its sections should open with '{first}' and close "
                                    f"with '{last}': {got_sections}")
            if screenshots:
                driver.save_screenshot(str(screenshots / f"{i:02d}_{page[:-5]}.png"))
    finally:
        driver.quit()
        server.shutdown()
    for p in problems:
        print(p)
    print(f"browser: {len(order)} pages at 1280 px, {len(checked)} link targets, "
          f"{len(problems)} problems" + (f"; screenshots in {screenshots}" if screenshots else ""))
    return 1 if problems else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    b = sub.add_parser("browser")
    b.add_argument("html", type=pathlib.Path)
    b.add_argument("--screenshots", type=pathlib.Path)
    sub.add_parser("github")
    a = ap.parse_args()
    return browser(a.html.resolve(), a.screenshots) if a.mode == "browser" else github()


if __name__ == "__main__":
    sys.exit(main())
