"""Token shards: one flat binary file of token ids per shard, memory-mapped for reading.

File format (version 1, all integers little-endian)::

    offset  size  field
    0       8     magic            b"EQTOKENS"
    8       4     format version   uint32, = 1
    12      4     dtype code       uint32: 2 = uint16 tokens, 4 = uint32 tokens (the item size)
    16      8     token count      uint64, number of tokens after the header
    24      8     document count   uint64, number of documents in the shard
    32      4     header size      uint32, byte offset of the first token (64 in version 1)
    36      4     eot id           uint32, the end-of-text token id
    40      4     vocab size       uint32, number of token ids of the tokenizer
    44      20    reserved         zero
    64      ...   tokens           token count x item size bytes

Each document's tokens are followed by one end-of-text token, so a shard holding
documents ``d1, d2`` is ``d1 EOT d2 EOT`` and its last token is EOT. Tokens are stored
as uint16 when the vocabulary has at most 65,536 ids, else uint32. The file size must be
exactly ``header size + token count x item size``; :func:`read_shard` checks this, the
magic, the version and the dtype, and raises :class:`ValueError` naming the file and the
problem otherwise. :func:`write_shard` writes to a temporary file in the same directory,
fsyncs it and renames it into place, so a shard file is either complete or absent.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["MAGIC", "FORMAT_VERSION", "HEADER_SIZE", "ShardHeader", "Shard", "dtype_for_vocab", "write_shard", "read_header", "read_shard"]

MAGIC = b"EQTOKENS"
FORMAT_VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sIIQQIII20x")
assert _HEADER.size == HEADER_SIZE
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    if vocab_size <= 0 or vocab_size > 2**32:
        raise ValueError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    return _DTYPES[2] if vocab_size <= 2**16 else _DTYPES[4]


@dataclass(frozen=True)
class ShardHeader:
    version: int
    dtype: np.dtype
    num_tokens: int
    num_documents: int
    header_size: int
    eot_id: int
    vocab_size: int


@dataclass(frozen=True)
class Shard:
    path: Path
    header: ShardHeader
    tokens: np.ndarray  # read-only numpy.memmap of shape (num_tokens,)

    def __len__(self) -> int:
        return self.header.num_tokens


def write_shard(
    path: str | os.PathLike,
    tokens: np.ndarray | Sequence[int],
    *,
    vocab_size: int,
    eot_id: int,
    num_documents: int,
) -> ShardHeader:
    """Write ``tokens`` as a shard at ``path`` atomically (temp file, fsync, rename)."""
    path = Path(path)
    dtype = dtype_for_vocab(vocab_size)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"{path}: tokens must be 1-D, got shape {arr.shape}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{path}: token ids must be in [0, {vocab_size}), got [{lo}, {hi}]")
    if not 0 <= eot_id < vocab_size:
        raise ValueError(f"{path}: eot_id {eot_id} outside [0, {vocab_size})")
    if num_documents < 0 or num_documents > arr.size:
        raise ValueError(f"{path}: num_documents {num_documents} impossible for {arr.size} tokens")
    arr = arr.astype(dtype, copy=False)
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, dtype.itemsize, arr.size, num_documents, HEADER_SIZE, eot_id, vocab_size
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
    return ShardHeader(FORMAT_VERSION, dtype, int(arr.size), num_documents, HEADER_SIZE, eot_id, vocab_size)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not supported on this platform
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_header(path: str | os.PathLike) -> ShardHeader:
    """Parse and check a shard's header against the file size; :class:`ValueError` if inconsistent."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_SIZE:
        raise ValueError(f"{path}: truncated shard: {size} bytes, smaller than the {HEADER_SIZE}-byte header")
    with open(path, "rb") as f:
        raw = f.read(HEADER_SIZE)
    magic, version, code, ntok, ndoc, hsize, eot, vocab = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise ValueError(f"{path}: not a token shard: bad magic {magic!r} (expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported shard format version {version} (this reader reads version {FORMAT_VERSION})")
    if code not in _DTYPES:
        raise ValueError(f"{path}: bad dtype code {code} (expected 2 for uint16 or 4 for uint32)")
    if hsize < HEADER_SIZE:
        raise ValueError(f"{path}: bad header size {hsize} (at least {HEADER_SIZE})")
    expected = hsize + ntok * code
    if size != expected:
        what = "truncated shard" if size < expected else "shard has trailing bytes"
        raise ValueError(
            f"{path}: {what}: header says {ntok} tokens ({expected} bytes with the header) but the file has {size} bytes"
        )
    if ndoc > ntok:
        raise ValueError(f"{path}: header says {ndoc} documents but only {ntok} tokens")
    if not 0 <= eot < vocab or (code == 2 and vocab > 2**16):
        raise ValueError(f"{path}: inconsistent header: eot id {eot}, vocab size {vocab}, dtype code {code}")
    return ShardHeader(version, _DTYPES[code], ntok, ndoc, hsize, eot, vocab)


def read_shard(path: str | os.PathLike) -> Shard:
    """Open a shard: its checked header and a read-only ``numpy.memmap`` of its tokens."""
    path = Path(path)
    header = read_header(path)
    if header.num_tokens == 0:
        tokens = np.zeros(0, dtype=header.dtype)
    else:
        tokens = np.memmap(path, dtype=header.dtype, mode="r", offset=header.header_size, shape=(header.num_tokens,))
        if header.num_documents and int(tokens[-1]) != header.eot_id:
            raise ValueError(f"{path}: corrupt shard: last token {int(tokens[-1])} is not the end-of-text id {header.eot_id}")
    return Shard(path, header, tokens)
