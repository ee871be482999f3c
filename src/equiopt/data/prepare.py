"""Tokenize a corpus into train/validation shards, resumably.

``prepare(corpus, tokenizer, out_dir)`` writes::

    out_dir/manifest.json
    out_dir/train_000000.bin, train_000001.bin, ...
    out_dir/val_000000.bin, ...

The split is decided per document: ``blake2b(seed || utf-8 text)`` read as a number in
[0, 1) below ``val_fraction`` means validation (:func:`document_split`). A document is
therefore in exactly one split, identical documents share a split, and the assignment
of a document never changes when the corpus grows or is reordered.

Within a split, documents keep corpus order; each is followed by the tokenizer's
end-of-text token, and a shard is closed at the first document boundary where it holds
at least ``shard_tokens`` tokens (the last shard of a split holds the rest).

``manifest.json`` is rewritten (atomically) after every shard with the run's settings and
each finished shard's file name, token and document counts, sha256, and the number of
corpus documents read when it was closed. A re-run with the same settings checks the
finished shards, skips the documents they hold without tokenizing them, and writes
only what is missing, producing the same bytes as an uninterrupted run; a re-run of a
finished job does nothing and says so. A re-run with different settings is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from ._fetch import sha256_file
from .corpora import Corpus, get_corpus
from .shards import FORMAT_VERSION, dtype_for_vocab, read_header, write_shard
from .tokenizers import Tokenizer, get_tokenizer

__all__ = ["prepare", "document_split", "load_manifest", "main", "SPLITS", "DEFAULT_SHARD_TOKENS"]

SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 10_000_000
MANIFEST = "manifest.json"
_BATCH_CHARS = 1 << 22  # tokenize about 4 M characters at a time


def _document_digest(text: str, seed: int) -> bytes:
    return hashlib.blake2b(seed.to_bytes(16, "little", signed=True) + text.encode("utf-8"), digest_size=16).digest()


def _split_of(digest: bytes, val_fraction: float) -> str:
    return "val" if int.from_bytes(digest[:8], "little") / 2.0**64 < val_fraction else "train"


def document_split(text: str, seed: int, val_fraction: float) -> str:
    """``"val"`` or ``"train"`` for one document: is ``blake2b(seed || text)``, as a fraction, below ``val_fraction``?"""
    return _split_of(_document_digest(text, seed), val_fraction)


def load_manifest(out_dir: str | os.PathLike) -> dict:
    path = Path(out_dir) / MANIFEST
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Progress:
    """tqdm when installed, else a line every ``every`` seconds."""

    def __init__(self, enabled: bool, log: Callable[[str], None], every: float = 10.0):
        self.enabled, self.log, self.every = enabled, log, every
        self.docs = self.tokens = 0
        self.t0 = self.last = time.perf_counter()
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(unit=" docs", desc="prepare", dynamic_ncols=True, mininterval=1.0)
            except ImportError:
                pass

    def update(self, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(docs)
            self.bar.set_postfix_str(f"{self.tokens / 1e6:.1f}M tokens", refresh=False)
            return
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            rate = self.tokens / max(now - self.t0, 1e-9)
            self.log(f"prepare: {self.docs:,} documents, {self.tokens:,} tokens ({rate / 1e6:.2f} M tokens/s)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _settings(corpus: str, tok: Tokenizer, shard_tokens: int, val_fraction: float, seed: int, max_documents) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "corpus": corpus,
        "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
        "dtype": dtype_for_vocab(tok.vocab_size).name,
        "shard_tokens": shard_tokens,
        "val_fraction": val_fraction,
        "seed": seed,
        "max_documents": max_documents,
    }


def _check_shards(out: Path, manifest: dict, verify: bool, log) -> bool:
    """Keep the longest prefix of each split's recorded shards that is intact; True if all were."""
    intact = True
    for split in SPLITS:
        kept = []
        for entry in manifest["shards"][split]:
            path = out / entry["file"]
            problem = None
            if not path.exists():
                problem = "missing"
            else:
                try:
                    header = read_header(path)
                    if header.num_tokens != entry["num_tokens"] or header.num_documents != entry["num_documents"]:
                        problem = "counts differ from the manifest"
                    elif verify and sha256_file(path) != entry["sha256"]:
                        problem = "sha256 differs from the manifest"
                except ValueError as e:
                    problem = str(e)
            if problem:
                log(f"{entry['file']}: {problem}; it and the {split} shards after it need to be rewritten")
                intact = False
                break
            kept.append(entry)
        manifest["shards"][split] = kept
    return intact


def _totals(manifest: dict) -> dict:
    return {
        split: {
            "shards": len(entries),
            "tokens": sum(e["num_tokens"] for e in entries),
            "documents": sum(e["num_documents"] for e in entries),
        }
        for split, entries in manifest["shards"].items()
    }


def _summary(manifest: dict) -> str:
    t = manifest["totals"]
    return ", ".join(f"{s}: {t[s]['tokens']:,} tokens, {t[s]['documents']:,} documents, {t[s]['shards']} shards" for s in SPLITS)


def prepare(
    corpus: str | Corpus | Iterable[str],
    tokenizer: str | Tokenizer,
    out_dir: str | os.PathLike,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_fraction: float = 0.01,
    seed: int = 0,
    max_documents: int | None = None,
    corpus_name: str | None = None,
    verify: bool = True,
    progress: bool = True,
    log: Callable[[str], None] = _stderr,
    on_shard: Callable[[str, dict], None] | None = None,
    cache: str | os.PathLike | None = None,
) -> dict:
    """Tokenize ``corpus`` into ``out_dir``; returns the manifest (also in ``out_dir/manifest.json``).

    ``corpus`` is a spec (see :func:`equiopt.data.corpora.get_corpus`), a :class:`Corpus`, or
    any iterable of strings (named by ``corpus_name``, default ``"custom"``; it must yield the
    same documents when a run is resumed). ``tokenizer`` is a spec for
    :func:`~equiopt.data.tokenizers.get_tokenizer` or a tokenizer. ``max_documents`` reads only
    the first documents of the corpus. ``verify`` re-hashes finished shards before trusting
    them. ``on_shard(split, entry)`` is called after each shard is written and recorded.
    """
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    if not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"val_fraction must be in [0, 1], got {val_fraction}")
    if isinstance(corpus, str):
        corpus = get_corpus(corpus, cache=cache)
    name = corpus_name or (corpus.name if isinstance(corpus, Corpus) else "custom")
    tok = get_tokenizer(tokenizer, cache=cache)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST
    settings = _settings(name, tok, shard_tokens, val_fraction, seed, max_documents)

    if manifest_path.exists():
        manifest = load_manifest(out)
        old = {k: manifest.get(k) for k in settings}
        if old != settings:
            diff = {k: (old[k], settings[k]) for k in settings if old[k] != settings[k]}
            raise ValueError(
                f"{manifest_path}: this directory was prepared with other settings "
                f"(setting: (recorded, requested)) {diff}; use another output directory or delete it"
            )
        intact = _check_shards(out, manifest, verify, log)
        if manifest.get("complete") and intact:
            log(f"prepare: {out} is already complete, nothing to do ({_summary(manifest)})")
            return manifest
        manifest["complete"] = False
        done = {s: sum(e["num_documents"] for e in manifest["shards"][s]) for s in SPLITS}
        if any(done.values()):
            log(f"prepare: resuming in {out}: {done['train']:,} train and {done['val']:,} val documents already written")
    else:
        manifest = {**settings, "complete": False, "shards": {s: [] for s in SPLITS}}
    manifest["totals"] = _totals(manifest)
    _write_json_atomic(manifest_path, manifest)

    # Documents of split s with corpus index below resume_at[s] are in finished shards.
    resume_at = {s: (manifest["shards"][s][-1]["end_document"] if manifest["shards"][s] else 0) for s in SPLITS}
    expected_skips = {s: sum(e["num_documents"] for e in manifest["shards"][s]) for s in SPLITS}
    # A running hash of each split's documents, recorded with every shard, proves on resume
    # that the documents being skipped are the ones the finished shards hold.
    chains = {s: hashlib.blake2b(digest_size=16) for s in SPLITS}
    skipped = dict.fromkeys(SPLITS, 0)
    checked = dict.fromkeys(SPLITS, False)
    buffers: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    buffered = dict.fromkeys(SPLITS, 0)
    buffered_docs = dict.fromkeys(SPLITS, 0)
    dtype = dtype_for_vocab(tok.vocab_size)
    eot = np.array([tok.eot_id], dtype=dtype)
    bar = _Progress(progress, log)
    t0 = time.perf_counter()
    new_tokens = 0

    def check_skips(split: str) -> None:
        if not checked[split]:
            checked[split] = True
            entries = manifest["shards"][split]
            same = skipped[split] == expected_skips[split] and (
                not entries or entries[-1]["documents_digest"] == chains[split].hexdigest()
            )
            if not same:
                raise ValueError(
                    f"{manifest_path}: the corpus changed since the interrupted run: the finished {split} shards hold "
                    f"{expected_skips[split]} documents, the corpus now has {skipped[split]} other or different "
                    "documents before that point; delete the directory to start over"
                )

    def close_shard(split: str, end_document: int) -> None:
        nonlocal new_tokens
        index = len(manifest["shards"][split])
        path = out / f"{split}_{index:06d}.bin"
        tokens = np.concatenate(buffers[split]) if buffers[split] else np.zeros(0, dtype=dtype)
        write_shard(path, tokens, vocab_size=tok.vocab_size, eot_id=tok.eot_id, num_documents=buffered_docs[split])
        entry = {
            "file": path.name,
            "num_tokens": int(tokens.size),
            "num_documents": buffered_docs[split],
            "sha256": sha256_file(path),
            "end_document": end_document,
            "documents_digest": chains[split].hexdigest(),
        }
        manifest["shards"][split].append(entry)
        manifest["totals"] = _totals(manifest)
        _write_json_atomic(manifest_path, manifest)
        new_tokens += int(tokens.size)
        buffers[split], buffered[split], buffered_docs[split] = [], 0, 0
        if on_shard is not None:
            on_shard(split, entry)

    def flush(pending: list[tuple[int, str, bytes, str]]) -> None:
        if not pending:
            return
        encoded = tok.encode_batch([text for *_, text in pending])
        ntok = 0
        for (index, split, digest, _), ids in zip(pending, encoded):
            chains[split].update(digest)
            buffers[split].append(np.asarray(ids, dtype=dtype))
            buffers[split].append(eot)
            buffered[split] += len(ids) + 1
            buffered_docs[split] += 1
            ntok += len(ids) + 1
            if buffered[split] >= shard_tokens:
                close_shard(split, index + 1)
        bar.update(len(pending), ntok)
        pending.clear()

    pending: list[tuple[int, str, bytes, str]] = []
    pending_chars = 0
    n_read = 0
    try:
        for index, text in enumerate(corpus):
            if max_documents is not None and index >= max_documents:
                break
            n_read = index + 1
            digest = _document_digest(text, seed)
            split = _split_of(digest, val_fraction)
            if index < resume_at[split]:
                skipped[split] += 1
                chains[split].update(digest)
                continue
            check_skips(split)
            pending.append((index, split, digest, text))
            pending_chars += len(text)
            if pending_chars >= _BATCH_CHARS:
                flush(pending)
                pending_chars = 0
        flush(pending)
        for split in SPLITS:
            check_skips(split)
            if buffered_docs[split]:
                close_shard(split, n_read)
    finally:
        bar.close()

    elapsed = time.perf_counter() - t0
    manifest["complete"] = True
    manifest["documents_read"] = n_read
    manifest["totals"] = _totals(manifest)
    manifest["last_run"] = {"seconds": round(elapsed, 3), "tokens_written": new_tokens}
    _write_json_atomic(manifest_path, manifest)
    log(f"prepare: done in {elapsed:.1f}s: {_summary(manifest)} -> {out}")
    return manifest


# ----------------------------------------------------------------------------- command line


def _info(out_dir: str, verify: bool) -> int:
    out = Path(out_dir)
    manifest = load_manifest(out)
    tok = manifest["tokenizer"]
    print(f"{out}: corpus {manifest['corpus']}, tokenizer {tok['name']} (vocab {tok['vocab_size']}, eot {tok['eot_id']}), "
          f"{manifest['dtype']}, {'complete' if manifest.get('complete') else 'INCOMPLETE'}")
    print(f"  {_summary(manifest)}")
    intact = _check_shards(out, json.loads(json.dumps(manifest)), verify, print)
    print("  shards intact" if intact else "  some shards are damaged: re-run prepare to repair")
    return 0 if intact else 1


def main(argv: list[str] | None = None) -> int:
    """``equiopt data {prepare,train-bpe,info} ...``."""
    parser = argparse.ArgumentParser(prog="equiopt data", description="Prepare tokenized pre-training data.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="tokenize a corpus into train/val shards (resumable)")
    p.add_argument("--corpus", required=True, help="poetry, sotu, fineweb-edu[:config], hf:<name>[:config], txt:<path>, jsonl:<path>, parquet:<path>, or a path")
    p.add_argument("--tokenizer", required=True, help="gpt2, qwen, bpe:<path.json>, hf:<name>")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-documents", type=int, default=None)
    p.add_argument("--cache", default=None, help="download cache (default $EQUIOPT_CACHE or ~/.cache/equiopt)")
    p.add_argument("--no-verify", action="store_true", help="trust finished shards without re-hashing them")
    p.add_argument("--no-progress", action="store_true")

    b = sub.add_parser("train-bpe", help="train a byte-level BPE tokenizer on a corpus")
    b.add_argument("--corpus", required=True)
    b.add_argument("--vocab-size", type=int, required=True)
    b.add_argument("--out", required=True, help="tokenizer JSON file")
    b.add_argument("--max-documents", type=int, default=None)
    b.add_argument("--cache", default=None)

    i = sub.add_parser("info", help="summarize a prepared directory and check its shards")
    i.add_argument("dir")
    i.add_argument("--no-verify", action="store_true")

    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(
            args.corpus, args.tokenizer, args.out, shard_tokens=args.shard_tokens, val_fraction=args.val_fraction,
            seed=args.seed, max_documents=args.max_documents, verify=not args.no_verify,
            progress=not args.no_progress, cache=args.cache,
        )
        return 0
    if args.command == "train-bpe":
        import itertools

        from .tokenizers import train_bpe

        docs = get_corpus(args.corpus, cache=args.cache)
        texts = itertools.islice(docs, args.max_documents) if args.max_documents else docs
        t0 = time.perf_counter()
        tok = train_bpe(texts, args.vocab_size, args.out)
        print(f"trained {tok.name} in {time.perf_counter() - t0:.1f}s -> {args.out}")
        return 0
    return _info(args.dir, verify=not args.no_verify)


if __name__ == "__main__":
    sys.exit(main())
