"""Tokenizers behind one small interface.

Every tokenizer has ``name``, ``vocab_size`` (number of token ids: the largest id plus
one, special tokens included), ``eot_id`` (the end-of-text token that separates
documents), ``encode(text) -> list[int]``, ``decode(ids) -> str`` and
``encode_batch(texts) -> list[list[int]]`` (multi-threaded where the backend allows).
``encode`` treats its input as plain text: a literal ``"<|endoftext|>"`` in a document is
encoded as ordinary characters, never as the special token.

:func:`get_tokenizer` builds one from a spec:

* ``"gpt2"``: GPT-2 BPE (``r50k_base``, 50,257 ids, ``<|endoftext|>`` = 50256) from the
  ``gpt2.tiktoken`` file in the ``openai-whisper==20250625`` source distribution
  (sha256-checked), run by ``tiktoken``.
* ``"qwen"``: the Qwen vocabulary (151,643 ranks + 208 special tokens = 151,851 ids,
  ``<|endoftext|>`` = 151643) from ``qwen.tiktoken`` in ``dashscope==2.0.2``
  (sha256-checked), run by ``tiktoken``.
* ``"bpe:<path.json>"``: a byte-level BPE saved by :func:`train_bpe` (HF ``tokenizers``).
* ``"hf:<name or dir>"``: ``transformers.AutoTokenizer.from_pretrained``.
* ``"bytes"``: UTF-8 bytes as ids 0-255 and end-of-text 256; no dependencies, for smoke tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from ._fetch import cache_dir, extract_member, fetch_pypi, sha256_file, verify_sha256

__all__ = [
    "Tokenizer",
    "TiktokenTokenizer",
    "BPETokenizer",
    "HFTokenizer",
    "ByteTokenizer",
    "get_tokenizer",
    "gpt2",
    "qwen",
    "train_bpe",
    "GPT2_PATTERN",
    "QWEN_PATTERN",
    "EOT_TOKEN",
]

PathLike = str | os.PathLike

EOT_TOKEN = "<|endoftext|>"

# GPT-2's pre-tokenizer: contractions, letter runs, digit runs, punctuation runs, spaces.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOT_ID = 50256
WHISPER_REQUIREMENT = "openai-whisper==20250625"
WHISPER_SDIST = "openai_whisper-20250625.tar.gz"
WHISPER_GPT2_MEMBER = "openai_whisper-20250625/whisper/assets/gpt2.tiktoken"
_WHISPER_SDIST_SHA256 = "37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96"
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"

# Qwen's pre-tokenizer: case-insensitive contractions, a letter run with at most one
# leading non-letter/non-digit, single digits, punctuation runs with trailing newlines,
# newline runs, spaces.
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_NUM_RANKS = 151_643
# Special tokens follow the ranks: <|endoftext|>, <|im_start|>, <|im_end|>, <|extra_0|> .. <|extra_204|>.
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>") + tuple(f"<|extra_{i}|>" for i in range(205))
DASHSCOPE_REQUIREMENT = "dashscope==2.0.2"
DASHSCOPE_WHEEL = "dashscope-2.0.2-py3-none-any.whl"
DASHSCOPE_QWEN_MEMBER = "dashscope/resources/qwen.tiktoken"
_DASHSCOPE_WHEEL_SHA256 = "0602d1800f7433bdb7953560986eaf5146454ed3988636c0a91963ba24e74258"
QWEN_TIKTOKEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"


def _default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class Tokenizer:
    """The common interface. Subclasses set ``name``, ``vocab_size``, ``eot_id``."""

    name: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


class TiktokenTokenizer(Tokenizer):
    """A ``tiktoken`` BPE from a ``.tiktoken`` ranks file, a regex pattern and special tokens."""

    def __init__(
        self,
        name: str,
        ranks_file: PathLike,
        pattern: str,
        special_tokens: dict[str, int],
        eot_token: str = EOT_TOKEN,
        expected_sha256: str | None = None,
        expected_ranks: int | None = None,
    ):
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as e:
            raise ImportError(f"the {name} tokenizer needs tiktoken: pip install tiktoken") from e
        if expected_sha256 is not None:
            verify_sha256(ranks_file, expected_sha256, f"{name} ranks")
        # Pass the file's own hash so tiktoken's path-keyed cache can never serve stale contents.
        ranks = load_tiktoken_bpe(os.fspath(ranks_file), sha256_file(ranks_file))
        if expected_ranks is not None and len(ranks) != expected_ranks:
            raise ValueError(f"{ranks_file}: {len(ranks)} ranks, expected {expected_ranks}")
        self.name = name
        self.encoding = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special_tokens)
        self.vocab_size = self.encoding.n_vocab
        self.eot_id = special_tokens[eot_token]

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(list(texts), num_threads=num_threads or _default_threads())


def gpt2(cache: PathLike | None = None) -> TiktokenTokenizer:
    """GPT-2's BPE (``r50k_base``) from the sha256-checked ``gpt2.tiktoken`` of openai-whisper's sdist."""
    root = cache_dir(cache)
    ranks = root / "gpt2.tiktoken"
    if not ranks.exists():
        sdist = fetch_pypi(WHISPER_REQUIREMENT, WHISPER_SDIST, _WHISPER_SDIST_SHA256, sdist=True, cache=root)
        extract_member(sdist, WHISPER_GPT2_MEMBER, ranks, GPT2_TIKTOKEN_SHA256)
    return TiktokenTokenizer(
        "gpt2", ranks, GPT2_PATTERN, {EOT_TOKEN: GPT2_EOT_ID},
        expected_sha256=GPT2_TIKTOKEN_SHA256, expected_ranks=50_256,
    )


def qwen(cache: PathLike | None = None) -> TiktokenTokenizer:
    """Qwen's vocabulary from the sha256-checked ``qwen.tiktoken`` of dashscope 2.0.2."""
    root = cache_dir(cache)
    ranks = root / "qwen.tiktoken"
    if not ranks.exists():
        wheel = fetch_pypi(DASHSCOPE_REQUIREMENT, DASHSCOPE_WHEEL, _DASHSCOPE_WHEEL_SHA256, cache=root)
        extract_member(wheel, DASHSCOPE_QWEN_MEMBER, ranks, QWEN_TIKTOKEN_SHA256)
    special = {tok: QWEN_NUM_RANKS + i for i, tok in enumerate(QWEN_SPECIAL_TOKENS)}
    return TiktokenTokenizer(
        "qwen", ranks, QWEN_PATTERN, special, expected_sha256=QWEN_TIKTOKEN_SHA256, expected_ranks=QWEN_NUM_RANKS
    )


class BPETokenizer(Tokenizer):
    """A byte-level BPE from HF ``tokenizers``, stored as one JSON file (see :func:`train_bpe`)."""

    def __init__(self, tokenizer, name: str | None = None, eot_token: str = EOT_TOKEN):
        self.tokenizer = tokenizer
        # Documents are plain text: special-token strings inside them are not special.
        tokenizer.encode_special_tokens = True
        eot = tokenizer.token_to_id(eot_token)
        if eot is None:
            raise ValueError(f"tokenizer has no {eot_token!r} token")
        self.eot_id = eot
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.name = name or f"bpe-{self.vocab_size}"

    @classmethod
    def load(cls, path: PathLike) -> BPETokenizer:
        from tokenizers import Tokenizer as _HFTokenizer

        path = Path(path)
        return cls(_HFTokenizer.from_file(os.fspath(path)), name=f"bpe:{path.name}@{sha256_file(path)[:12]}")

    def save(self, path: PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer.encode_special_tokens = False  # keep the saved file free of this runtime switch
        try:
            self.tokenizer.save(os.fspath(path))
        finally:
            self.tokenizer.encode_special_tokens = True
        return path

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        # tokenizers parallelises batches itself (RAYON_NUM_THREADS / TOKENIZERS_PARALLELISM).
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    path: PathLike | None = None,
    *,
    min_frequency: int = 2,
    show_progress: bool = False,
) -> BPETokenizer:
    """Train a byte-level BPE of ``vocab_size`` ids (256 byte tokens, merges, and ``<|endoftext|>``).

    Saved as JSON to ``path`` when given (load it back with ``get_tokenizer("bpe:<path>")``).
    """
    try:
        from tokenizers import Tokenizer as _HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        raise ImportError("training a BPE needs the tokenizers package: pip install tokenizers") from e
    if vocab_size < 257:
        raise ValueError(f"a byte-level BPE needs vocab_size >= 257 (256 bytes + end of text), got {vocab_size}")
    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bpe = BPETokenizer(tok)
    if path is not None:
        bpe.save(path)
        bpe = BPETokenizer.load(path)
    return bpe


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as token ids 0..255, end of text 256 (vocab_size 257)."""

    name = "bytes"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        parts, start = [], 0
        for k, i in enumerate(ids + [self.eot_id]):
            if i == self.eot_id:
                parts.append(bytes(ids[start:k]).decode("utf-8", errors="replace"))
                start = k + 1
        return EOT_TOKEN.join(parts)


class HFTokenizer(Tokenizer):
    """Any ``transformers`` tokenizer (hub name or local directory) via ``AutoTokenizer``."""

    def __init__(self, name_or_path: str, eot_token: str | None = None, **kwargs):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
        self.name = f"hf:{name_or_path}"
        if eot_token is not None:
            eot = self.tokenizer.convert_tokens_to_ids(eot_token)
        else:
            eot = self.tokenizer.eos_token_id
            if eot is None:
                eot = self.tokenizer.convert_tokens_to_ids(EOT_TOKEN)
        if eot is None or eot == self.tokenizer.unk_token_id:
            raise ValueError(f"{name_or_path}: no end-of-text token (pass eot_token=...)")
        self.eot_id = int(eot)
        self.vocab_size = len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        return self.tokenizer(list(texts), add_special_tokens=False, split_special_tokens=True)["input_ids"]


def get_tokenizer(spec: str | Tokenizer, *, cache: PathLike | None = None) -> Tokenizer:
    """``"gpt2"``, ``"qwen"``, ``"bpe:<path.json>"``, ``"hf:<name or dir>"``, ``"bytes"`` (a Tokenizer is returned as is)."""
    if isinstance(spec, Tokenizer):
        return spec
    if spec in ("gpt2", "r50k_base"):
        return gpt2(cache)
    if spec == "qwen":
        return qwen(cache)
    if spec == "bytes":
        return ByteTokenizer()
    kind, _, arg = spec.partition(":")
    if kind == "bpe" and arg:
        return BPETokenizer.load(arg)
    if kind == "hf" and arg:
        return HFTokenizer(arg)
    raise ValueError(f"unknown tokenizer {spec!r}: expected gpt2, qwen, bpe:<path.json>, hf:<name> or bytes")
