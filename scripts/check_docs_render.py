"""Find Markdown in the documentation pages that did not render.

Python-Markdown, which mkdocs uses, ends a list when a continuation paragraph is indented
by fewer than four spaces; the next ``- `` line then joins the paragraph before it as
literal text. ``mkdocs build --strict`` does not see that. This script renders every page
under ``docs/`` with the Markdown extensions ``mkdocs.yml`` configures (and the settings
table the ``fields_table`` hook inserts), then reads the HTML and reports text blocks
(paragraphs, list items, table cells, headings) that hold what should have been markup:

- a line starting with a list marker (``- ``, ``* ``, ``1. ``);
- emphasis left as text: ``**``, a pair of backticks, ``_word_`` or ``*word*``;
- a table row, ``| a | b |``.

It also reads the source for one mistake the HTML cannot show: a bulleted list right after a
numbered one (or the reverse), with nothing but blank lines between, which Python-Markdown
renders as more items of the first list.

Text inside ``<code>`` and ``<pre>`` is ignored. Each finding names the page and the
source line it comes from (found by its words; ``?`` when the line cannot be found).

    python scripts/check_docs_render.py            # every page; exit status 1 on findings
    python scripts/check_docs_render.py docs/step.md
"""

from __future__ import annotations

import html.parser
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
SKIP_DIRS = {"hooks"}

# Blocks whose own text is checked. A list item's text is checked apart from the
# paragraphs it holds: a tight list puts its text straight into the <li>.
TEXT_BLOCKS = {"p", "li", "td", "th", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "summary"}
CODE = {"code", "pre", "script", "style"}
VOID = {"br", "img", "hr", "input", "meta", "link", "wbr", "source", "col", "area", "base"}
SNIPPET = re.compile(r'^-{1,}8<-{1,}\s+"([^"]+)"', re.M)
HOLE = "\x00"  # stands where a code span was: its text is never checked

LIST_MARKER = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+\S")
TABLE_ROW = re.compile(r"^\s*\|.*\|.*\|\s*$")
EMPHASIS = [
    ("literal '**'", re.compile(r"\*\*")),
    ("a pair of backticks", re.compile(r"`[^`\n]*`")),
    ("literal '_word_'", re.compile(r"(?<![\w\\])_[^_\s](?:[^_\n]*[^_\s])?_(?![\w])")),
    ("literal '*word*'", re.compile(r"(?<![\w*\\])\*[^*\s](?:[^*\n]*[^*\s])?\*(?![\w*])")),
]


@dataclass
class Finding:
    page: str  # the file the line comes from: the page, or a file it includes
    line: int | None
    what: str
    text: str

    def __str__(self) -> str:
        where = f"{self.page}:{self.line if self.line is not None else '?'}"
        return f"{where}: {self.what}: {self.text.strip()[:100]!r}"


class _Blocks(html.parser.HTMLParser):
    """The text of every text block in a page's HTML, code spans replaced by ``HOLE``."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self._stack: list[list[str]] = []
        self._code = 0

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in VOID:
            return
        if tag in CODE:
            if self._code == 0 and self._stack:
                self._stack[-1].append(HOLE)
            self._code += 1
        elif tag in TEXT_BLOCKS and self._code == 0:
            self._stack.append([])

    def handle_endtag(self, tag: str) -> None:
        if tag in CODE:
            self._code = max(0, self._code - 1)
        elif tag in TEXT_BLOCKS and self._code == 0 and self._stack:
            self.blocks.append("".join(self._stack.pop()))

    def handle_data(self, data: str) -> None:
        if self._code == 0 and self._stack:
            self._stack[-1].append(data)


def _markdown():
    """A Markdown converter with the extensions and settings of ``mkdocs.yml``."""
    import markdown
    from mkdocs.config import load_config

    config = load_config(str(REPO / "mkdocs.yml"))
    mdx_configs = {name: dict(settings) for name, settings in config.mdx_configs.items()}
    snippets = mdx_configs.setdefault("pymdownx.snippets", {})
    snippets.setdefault("base_path", [str(REPO)])
    return markdown.Markdown(extensions=config.markdown_extensions, extension_configs=mdx_configs)


def _fields_table_hook():
    spec = importlib.util.spec_from_file_location("_fields_table_hook", DOCS / "hooks" / "fields_table.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def _sources(path: Path, text: str) -> list[tuple[str, list[str]]]:
    """The files a page's lines come from: the page, then the files it includes as snippets."""
    sources = [(path.resolve().relative_to(REPO).as_posix(), text.splitlines())]
    for name in SNIPPET.findall(text):
        included = REPO / name
        if included.is_file():
            sources.append((name, included.read_text(encoding="utf-8").splitlines()))
    return sources


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9]+", text)


def _source_line(source_lines: list[str], text: str) -> int | None:
    """The 1-based line of the page source that a rendered line of text comes from."""
    for segment in sorted(text.split(HOLE), key=len, reverse=True):
        words = _words(segment)
        for size in (5, 4, 3, 2):
            for start in range(max(1, len(words) - size + 1)):
                window = words[start : start + size]
                if len(window) < min(size, len(words)) or not window:
                    continue
                pattern = re.compile(r"[^A-Za-z0-9]+".join(map(re.escape, window)))
                for number, line in enumerate(source_lines, 1):
                    if pattern.search(line):
                        return number
    return None


def _locate(sources: list[tuple[str, list[str]]], text: str) -> tuple[str, int | None]:
    for name, lines in sources:
        number = _source_line(lines, text)
        if number is not None:
            return name, number
    return sources[0][0], None


BULLET = re.compile(r"^[-*+]\s+\S")
NUMBERED = re.compile(r"^\d+[.)]\s+\S")
FENCE = re.compile(r"^\s*(```|~~~)")


def check_source(page: str, source: str) -> list[Finding]:
    """Top-level lists of the other kind that Python-Markdown joins to the list before them."""
    findings: list[Finding] = []
    kind = None  # the top-level list the lines are in: "bullet", "numbered" or None
    fence = None
    blank = True
    for number, line in enumerate(source.splitlines(), 1):
        match = FENCE.match(line)
        if fence is not None:  # inside a fenced block: only its closing fence counts
            fence = None if match and match.group(1) == fence else fence
            continue
        if match:
            fence = match.group(1)
            kind = kind if line.startswith((" ", "\t")) else None
            continue
        if not line.strip() or line.startswith((" ", "\t")):  # blank, or inside an item
            blank = not line.strip()
            continue
        this = "bullet" if BULLET.match(line) else "numbered" if NUMBERED.match(line) else None
        if this is not None and kind is not None and this != kind:
            what = f"a {this} list joined to the {kind} list before it (put a sentence between)"
            findings.append(Finding(page, number, what, line))
        if this is not None:
            kind = this
        elif blank:  # a paragraph after a blank line ends the list; without one it continues an item
            kind = None
        blank = False
    return findings


def check_html(page: str, html_text: str, source: str | list[tuple[str, list[str]]]) -> list[Finding]:
    """What in a page's HTML is Markdown that did not render.

    ``source`` is the page's Markdown, or (file, lines) pairs to look the lines up in.
    """
    parser = _Blocks()
    parser.feed(html_text)
    parser.close()
    sources = [(page, source.splitlines())] if isinstance(source, str) else source
    findings: list[Finding] = []
    for block in parser.blocks:
        for line in block.split("\n"):
            checks: list[str] = []
            if LIST_MARKER.match(line):
                checks.append("list marker left as text")
            if TABLE_ROW.match(line):
                checks.append("table row left as text")
            for what, pattern in EMPHASIS:
                if any(HOLE not in m.group(0) for m in pattern.finditer(line)):
                    checks.append(what)
            for what in checks:
                shown = line.replace(HOLE, "`...`")
                findings.append(Finding(*_locate(sources, line), what, shown))
    return findings


def pages(docs: Path = DOCS) -> list[Path]:
    """Every Markdown page of the site."""
    return sorted(p for p in docs.rglob("*.md") if not SKIP_DIRS & set(p.relative_to(docs).parts))


def check_pages(paths: list[Path] | None = None) -> list[Finding]:
    """Render each page as mkdocs does and list what did not render."""
    md = _markdown()
    hook = None
    findings: list[Finding] = []
    for path in paths if paths is not None else pages():
        text = path.read_text(encoding="utf-8")
        rendered = text
        if "<!-- fields-table -->" in text:  # the settings table the fields_table hook inserts
            hook = hook or _fields_table_hook()
            rendered = hook.on_page_markdown(text, None, None, None)
        md.reset()
        html_text = md.convert(rendered)
        sources = _sources(path, text)
        findings.extend(check_source(sources[0][0], text))
        findings.extend(check_html(sources[0][0], html_text, sources))
    return findings


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    paths = [Path(a) for a in args] if args else None
    findings = check_pages(paths)
    for finding in findings:
        print(finding)
    count = len(paths) if paths is not None else len(pages())
    print(f"{len(findings)} finding(s) in {count} page(s)", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
