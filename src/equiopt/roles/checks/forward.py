"""Running the model for the checks: the default forward call (``input_ids=`` for
Hugging Face models), the logits in its output, and what the input is drawn from (the
device and dtype of a reference parameter, the vocabulary size)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn

from ..inference.embeddings import input_embedding
from ..table import RoleTable


def _reference_param(model: nn.Module, table: RoleTable) -> Tensor:
    for r in table:
        if r.param.is_floating_point():
            return r.param
    for p in model.parameters():
        if p.is_floating_point():
            return p
    raise ValueError("the model has no floating-point parameters")


def _vocab_size(model: nn.Module, table: RoleTable) -> int:
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None)
    for c in (config, text):
        v = getattr(c, "vocab_size", None) if c is not None else None
        if isinstance(v, int) and v > 0:
            return v
    for r in table:
        if r.role == "embedding" and r.layout is not None:
            return r.layout.work_shapes(r.shape, r.name)[0][-2]
    emb = input_embedding(model)
    if isinstance(emb, nn.Embedding):
        return emb.num_embeddings
    raise ValueError("cannot tell the vocabulary size: pass input_ids")


def _default_forward(model: nn.Module) -> Callable[[nn.Module, Tensor], Any]:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "input_ids" in params:
        if "use_cache" in params:
            return lambda m, ids: m(input_ids=ids, use_cache=False)
        return lambda m, ids: m(input_ids=ids)
    return lambda m, ids: m(ids)


def _logits(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(out, Mapping) and isinstance(out.get("logits"), Tensor):
        return out["logits"]
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise TypeError(f"cannot find logits in the model output of type {type(out).__name__}; pass forward_fn")
