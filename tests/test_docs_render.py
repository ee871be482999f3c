"""The documentation pages render: no list, emphasis or table left as literal Markdown text.

``mkdocs build --strict`` checks links and anchors, not whether a list item, a bold phrase or
a table row came out as markup. ``scripts/check_docs_render.py`` renders each page with the
Markdown extensions of ``mkdocs.yml`` and reads the HTML; these tests run it (skipped where
mkdocs is not installed; the ``docs`` extra installs it).
"""

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("markdown")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("check_docs_render", REPO / "scripts" / "check_docs_render.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def render(check, text: str):
    md = check._markdown()
    return check.check_html("page.md", md.convert(text), text)


# A list whose items go on in paragraphs indented by two spaces: Python-Markdown needs four,
# so the list ends after the first paragraph and "- Second" joins the paragraph before it.
# Indented by four, the paragraph stays in the item, but "- Second" still joins it unless a
# blank line comes first.
TWO_SPACE_CONTINUATION = """\
# A page

- **First.** One paragraph of the first item.

  Its second paragraph, indented by two spaces.
- **Second.** The next item.
"""


def test_two_space_continuation_is_found(check):
    findings = render(check, TWO_SPACE_CONTINUATION)
    assert [(f.line, f.what) for f in findings] == [(6, "list marker left as text")]
    assert "page.md:6" in str(findings[0])
    four_spaces = TWO_SPACE_CONTINUATION.replace("\n  Its", "\n    Its")
    assert [(f.line, f.what) for f in render(check, four_spaces)] == [(6, "list marker left as text")]
    assert render(check, four_spaces.replace("\n- **Second", "\n\n- **Second")) == []


def test_table_without_blank_line_is_found(check):
    text = "Some text.\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    lines = {(f.line, f.what) for f in render(check, text)}
    assert (2, "table row left as text") in lines
    assert render(check, text.replace("text.\n", "text.\n\n")) == []


def test_literal_emphasis_is_found(check):
    html = (
        "<p>a ** b</p><p>a `span` b</p><p>an _under_ word</p><p>a *star* word</p>"
        "<p>fine: <code>**x** `y` _z_ - w</code>, <strong>bold</strong>, snake_case_name, 8 x 1024, a*b</p>"
    )
    source = "a ** b\na `span` b\nan _under_ word\na *star* word\n"
    found = [(f.line, f.what) for f in check.check_html("page.md", html, source)]
    assert found == [
        (1, "literal '**'"),
        (2, "a pair of backticks"),
        (3, "literal '_word_'"),
        (4, "literal '*word*'"),
    ]


def test_bullets_right_after_a_numbered_list_are_found(check):
    text = "Steps:\n\n1. one\n2. two\n\n- a bullet\n- another\n"
    assert [(f.line, f.what) for f in check.check_source("page.md", text)] == [
        (6, "a bullet list joined to the numbered list before it (put a sentence between)")
    ]
    html = check._markdown().convert(text)
    assert "<ul>" not in html  # the reason: Python-Markdown numbers the bullets on
    assert check.check_source("page.md", text.replace("\n\n- a", "\n\nThen:\n\n- a")) == []
    assert check.check_source("page.md", "- a\n  1. nested\n\n```\n1. code\n```\n- b\n") == []


def test_code_blocks_are_ignored(check):
    text = "Text.\n\n```text\n- a\n| a | b |\n**x**\n```\n\n    - indented code\n"
    assert render(check, text) == []


def test_every_page_renders(check):
    findings = check.check_pages()
    assert not findings, (
        "Markdown left as text (a list item's paragraphs go indented by 4 spaces, with a blank line before the next item):\n"
        + "\n".join(map(str, findings))
    )
