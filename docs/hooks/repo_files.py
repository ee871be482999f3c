"""mkdocs hook: links from the pages to repository files outside ``docs/``.

The pages link the repository's own files relatively (``../results/engine.md``,
``../examples/``), so the links work where the Markdown is read in the repository. In the
built site those files are not pages: the hook copies each linked file (a folder link
means its ``README.md``) into the site under ``repo/``, as it is, and points the link at
the copy, so ``mkdocs build --strict`` still checks that every such target exists.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")
COPIES = "repo"


class RepoFile(File):
    """A repository file copied into the site as it is (a ``.md`` one is not rendered)."""

    def is_documentation_page(self) -> bool:
        return False

    def is_static_page(self) -> bool:
        return False


def _repo_target(page_uri: str, link: str, docs_dir: Path, repo: Path) -> str | None:
    """The repository-relative path a page's relative link points at, when it leaves docs/."""
    if "://" in link or link.startswith(("/", "mailto:")):
        return None
    docs_rel = docs_dir.relative_to(repo).as_posix()
    target = posixpath.normpath(posixpath.join(docs_rel, posixpath.dirname(page_uri), link))
    if target.startswith("..") or target == docs_rel or target.startswith(docs_rel + "/"):
        return None
    path = repo / target
    if path.is_dir() and (path / "README.md").is_file():
        return f"{target}/README.md"
    return target if path.is_file() else None


def _links(config) -> tuple[Path, Path]:
    docs_dir = Path(config["docs_dir"]).resolve()
    return docs_dir, Path(config["config_file_path"]).resolve().parent


def on_files(files: Files, config) -> Files:
    docs_dir, repo = _links(config)
    wanted: set[str] = set()
    for file in files.documentation_pages():
        text = Path(file.abs_src_path).read_text(encoding="utf-8")
        for match in LINK.finditer(text):
            target = _repo_target(file.src_uri, match.group(2), docs_dir, repo)
            if target is not None:
                wanted.add(target)
    for target in sorted(wanted):
        files.append(
            RepoFile(
                f"{COPIES}/{target}",
                src_dir=None,
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
        files.get_file_from_path(f"{COPIES}/{target}").abs_src_path = str(repo / target)
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    docs_dir, repo = _links(config)

    def relink(match: re.Match[str]) -> str:
        target = _repo_target(page.file.src_uri, match.group(2), docs_dir, repo)
        if target is None:
            return match.group(0)
        new = posixpath.relpath(f"{COPIES}/{target}", posixpath.dirname(page.file.src_uri) or ".")
        return f"{match.group(1)}{new}{match.group(3) or ''}{match.group(4)}"

    return LINK.sub(relink, markdown)
