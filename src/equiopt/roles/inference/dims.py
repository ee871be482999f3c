"""The dimensions inference reads (:class:`ModelDims`) and where each comes from: a model
config (Hugging Face names and common alternatives), a block's own attributes, the input
embedding, or ``dims=``; :func:`model_dims` gives those of a whole model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from .embeddings import input_embedding
from .names import _ATTN_CLASS


@dataclass
class ModelDims:
    """The dimensions role inference reads: from a config, a block's attributes or ``dims=``.

    Args:
        hidden: the hidden (model) size.
        heads: attention heads.
        kv_heads: key/value heads (grouped-query attention); defaults to ``heads``.
        head_dim: the size of one head; defaults to ``hidden // heads``.
        experts: experts of an MoE layer.
        vocab: the vocabulary size.
    """

    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    experts: int | None = None
    vocab: int | None = None


# Config fields (Hugging Face names and common alternatives) that give each dimension.
_CONFIG_KEYS = {
    "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads", "num_kv_heads"),
    "head_dim": ("head_dim", "kv_channels"),
    "experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    "vocab": ("vocab_size",),
}
# Attributes of a module itself (an attention or MoE block, nn.MultiheadAttention, a user's
# block) that give its own dimensions; the nearest module that has one wins, so blocks
# that differ from each other (or from the model config) keep their own.
_MODULE_KEYS = {
    "heads": ("num_heads", "num_attention_heads", "n_head", "n_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head"),
    "head_dim": ("head_dim", "head_size", "attention_head_size"),
    "experts": ("num_experts", "num_local_experts", "n_routed_experts", "n_experts"),
}


def _cfg(config: Any, *names: str):
    for n in names:
        v = getattr(config, n, None) if not isinstance(config, Mapping) else config.get(n)
        if v is not None:
            return v
    return None


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _model_config(module: nn.Module) -> Any:
    """The model config a module carries (``module.config``; a multimodal config's
    ``text_config``), or None when it has none or it names no dimension."""
    config = getattr(module, "config", None)
    if config is None or isinstance(config, (str, bytes, int, float)):
        return None
    text = getattr(config, "text_config", None) if not isinstance(config, Mapping) else config.get("text_config")
    if text is not None and _cfg(config, *_CONFIG_KEYS["hidden"]) is None:
        config = text
    if not any(_positive_int(_cfg(config, *keys)) for keys in _CONFIG_KEYS.values()):
        return None
    return config


def _from_config(dims: ModelDims, config: Any) -> None:
    for key, names in _CONFIG_KEYS.items():
        if getattr(dims, key) is None:
            setattr(dims, key, _positive_int(_cfg(config, *names)))


def _from_module(dims: ModelDims, module: nn.Module) -> None:
    for key, names in _MODULE_KEYS.items():
        if getattr(dims, key) is None:
            setattr(dims, key, next((v for n in names if (v := _positive_int(getattr(module, n, None)))), None))
    if dims.hidden is None and _ATTN_CLASS.search(type(module).__name__):
        dims.hidden = _positive_int(getattr(module, "embed_dim", None))


def _finish(dims: ModelDims, overrides: Mapping[str, Any] | None) -> ModelDims:
    for key, value in (overrides or {}).items():
        if not hasattr(dims, key):
            raise ValueError(f"unknown model dimension {key!r}; valid: {', '.join(ModelDims.__dataclass_fields__)}")
        setattr(dims, key, value)
    dims.kv_heads = dims.kv_heads or dims.heads
    if dims.head_dim is None and dims.hidden and dims.heads:
        dims.head_dim = dims.hidden // dims.heads
    return dims


def _first_config(model: nn.Module) -> Any:
    """The config of the outermost module that has one: the model's, wherever a wrapper put it."""
    for _, module in model.named_modules():
        config = _model_config(module)
        if config is not None:
            return config
    return None


def _model_level_dims(model: nn.Module) -> ModelDims:
    """The dimensions of the whole model, before defaults and overrides: its outermost
    config, then the hidden size and vocabulary of its input embedding."""
    dims = ModelDims()
    config = _first_config(model)
    if config is not None:
        _from_config(dims, config)
    emb = input_embedding(model, dims.vocab)
    if emb is not None and getattr(emb, "weight", None) is not None and emb.weight.ndim == 2:
        dims.vocab = dims.vocab or emb.weight.shape[0]
        dims.hidden = dims.hidden or emb.weight.shape[1]
    return dims


def model_dims(model: nn.Module, overrides: Mapping[str, Any] | None = None) -> ModelDims:
    """Hidden size, heads, head dim and experts from the model config (HF names) and the embedding.

    The config is the outermost one in the module tree, so a model reached through a
    wrapper (DDP's ``.module``, a LightningModule attribute, ``torch.compile``) has the
    dimensions of the bare model. :func:`assign_roles` refines them per block.

    Args:
        model: the model, bare or wrapped.
        overrides: dimensions to set whatever the config says (keys: the fields of
            :class:`ModelDims`).

    Returns:
        The dimensions found; None where none was.

    Raises:
        ValueError: for an unknown key in ``overrides``.
    """
    return _finish(_model_level_dims(model), overrides)
