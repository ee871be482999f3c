"""Pre-training data that works without a model/data hub.

* :mod:`equiopt.data.corpora`: document streams (Gutenberg poetry and State of the Union
  addresses from sha256-checked registry packages, local txt/jsonl/parquet files,
  Hugging Face ``datasets``), and :func:`get_corpus` for spec strings.
* :mod:`equiopt.data.tokenizers`: ``gpt2``, ``qwen``, local byte-level BPE and hub
  tokenizers behind one interface; :func:`get_tokenizer`.
* :mod:`equiopt.data.shards`: the binary token-shard format (memory-mapped reads).
* :mod:`equiopt.data.prepare`: corpus -> train/val shards, resumable
  (``from equiopt.data.prepare import prepare``; ``main`` is ``equiopt data ...``).
* :mod:`equiopt.data.loader`: :class:`TokenLoader` (reproducible, data-parallel,
  checkpointable training batches) and :class:`ValidationBatches`.

Typical use::

    from equiopt.data.prepare import prepare
    from equiopt.data import TokenLoader, ValidationBatches

    prepare("poetry", "gpt2", "data/poetry-gpt2")
    train = TokenLoader("data/poetry-gpt2", batch_size=64, seq_len=1024, seed=0, rank=r, world_size=w)
    x, y = next(train)
"""

from ._fetch import ChecksumError, cache_dir
from .corpora import Corpus, get_corpus
from .loader import TokenLoader, TokenStream, ValidationBatches
from .shards import Shard, ShardHeader, read_shard, write_shard
from .tokenizers import Tokenizer, get_tokenizer, train_bpe

__all__ = [
    "ChecksumError",
    "cache_dir",
    "Corpus",
    "get_corpus",
    "Tokenizer",
    "get_tokenizer",
    "train_bpe",
    "Shard",
    "ShardHeader",
    "read_shard",
    "write_shard",
    "TokenStream",
    "TokenLoader",
    "ValidationBatches",
]
