"""The input embedding and the output embedding (LM head) of a model, under whatever
wrappers hold it, and whether the two are tied (one parameter)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

if TYPE_CHECKING:
    from .dims import ModelDims


def _call(module: Any, method: str):
    get = getattr(module, method, None)
    if not callable(get):
        return None
    try:
        out = get()
    except (NotImplementedError, AttributeError, TypeError):
        return None
    return out if isinstance(out, nn.Module) else None


def _embedding_owners(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules that name their input embedding (``get_input_embeddings``):
    the Hugging Face models in the tree, under whatever wrappers hold them."""
    owners: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(o == "" or name == o or name.startswith(o + ".") for o, _ in owners):
            continue
        if _call(module, "get_input_embeddings") is not None:
            owners.append((name, module))
    return owners


def input_embedding(model: nn.Module, vocab: int | None = None):
    """The input embedding of ``model`` (the first one, when a wrapper holds several models)."""
    for _, owner in _embedding_owners(model):
        return _call(owner, "get_input_embeddings")
    embs = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if len(embs) > 1 and vocab is not None:
        embs = [m for m in embs if m.num_embeddings == vocab]
    return embs[0] if len(embs) == 1 else None


def _output_embedding(model: nn.Module, dims: ModelDims):
    out = _call(model, "get_output_embeddings")
    if out is not None:
        return out
    if dims.vocab is None:
        return None
    heads = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == dims.vocab]
    return heads[-1] if heads else None


class _Embeddings(NamedTuple):
    """The input embeddings and LM heads of a model, by ``id`` of their weight, and
    whether an input embedding and an LM head share one weight."""

    inputs: dict[int, nn.Module]
    heads: dict[int, nn.Module]
    tied: bool


def _find_embeddings(model: nn.Module, dims_at: Callable[[str], ModelDims]) -> _Embeddings:
    """The input and output embeddings of every model in the tree (``dims_at``: the
    dimensions in force at a module path, whose vocabulary finds an LM head)."""
    embeddings: dict[int, nn.Module] = {}
    lm_heads: dict[int, nn.Module] = {}
    tied = False
    owners = _embedding_owners(model) or [("", model)]
    for owner_name, owner in owners:
        emb = _call(owner, "get_input_embeddings") or input_embedding(owner, dims_at(owner_name).vocab)
        out = _output_embedding(owner, dims_at(owner_name))
        for module, found in ((emb, embeddings), (out, lm_heads)):
            w = getattr(module, "weight", None) if module is not None else None
            if isinstance(w, torch.Tensor):
                found[id(w)] = module
        if emb is not None and out is not None and getattr(out, "weight", None) is getattr(emb, "weight", 0):
            tied = True
    return _Embeddings(embeddings, lm_heads, tied)
