"""What is in force around a parameter while inference decides its role: the attention
or MLP block that encloses it, the dimensions there (nearest block attributes and
config first), the model type, the model's embeddings and LM heads, and the error that
names the parameter and its fix. The rules for each kind of block build on
:class:`_ContextBase`."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from ...layouts import Layout
from .dims import ModelDims, _finish, _from_config, _from_module, _model_config, _model_level_dims
from .embeddings import _find_embeddings
from .errors import RoleInferenceError
from .names import _ATTN_CLASS, _MLP_CLASS
from .storage import _Orientation, _orientation


class _Decision(NamedTuple):
    """What inference decided for one parameter: its role, its layout (None for a
    vector) and the reason shown in the role table."""

    role: str
    layout: Layout | None
    reason: str


class _BlockContext(NamedTuple):
    """The nearest attention or MLP block around a module: ``kind`` (``"attention"`` or
    ``"mlp"``), its module path and the block module itself."""

    kind: str
    path: str
    module: nn.Module


class _ContextBase:
    def __init__(self, model: nn.Module, overrides: Mapping[str, Any] | None, split: bool, per_head: bool):
        self.model, self.split, self.per_head = model, split, per_head
        self.overrides = dict(overrides or {})
        _finish(ModelDims(), self.overrides)  # unknown keys fail here, before any inference
        self.modules = dict(model.named_modules())
        # dimensions no block or config gives: hidden size and vocabulary from the embedding
        self.fallback = _model_level_dims(model)
        self._dims: dict[str, ModelDims] = {}
        self.dims = self.dims_at("")  # the dimensions in force for the parameter being inferred
        found = _find_embeddings(model, self.dims_at)
        self.embeddings, self.lm_heads, self.tied = found.inputs, found.heads, found.tied
        self.probed: list[str] = []

    def _ancestors(self, mod_name: str):
        parts = mod_name.split(".") if mod_name else []
        for i in range(len(parts), -1, -1):
            key = ".".join(parts[:i])
            if key in self.modules:
                yield key, self.modules[key]

    def dims_at(self, mod_name: str) -> ModelDims:
        """Dimensions in force at a module: nearest block attributes and config first."""
        if mod_name in self._dims:
            return self._dims[mod_name]
        d = ModelDims()
        for _, mod in self._ancestors(mod_name):
            _from_module(d, mod)
            config = _model_config(mod)
            if config is not None:
                _from_config(d, config)
        for key in ModelDims.__dataclass_fields__:
            if getattr(d, key) is None:
                setattr(d, key, getattr(self.fallback, key))
        if d.experts is None:
            d.experts = self._experts_of(mod_name)
        self._dims[mod_name] = _finish(d, self.overrides)
        return self._dims[mod_name]

    def _experts_of(self, mod_name: str) -> int | None:
        """Expert count from the MoE block's structure: an ``experts`` module list, or the
        leading axis of its 3-D expert tensors."""
        found = self._context_of(mod_name)
        if found is None or found.kind != "mlp":
            return None
        block = found.module
        experts = getattr(block, "experts", None)
        if isinstance(experts, (nn.ModuleList, Sequence)) and not isinstance(experts, str) and len(experts) > 1:
            return len(experts)
        counts = {q.shape[0] for q in block.parameters() if q.ndim == 3}
        return counts.pop() if len(counts) == 1 else None

    def _context_of(self, mod_name: str) -> _BlockContext | None:
        for key, mod in self._ancestors(mod_name):
            cls = type(mod).__name__
            if _ATTN_CLASS.search(cls) and "norm" not in cls.lower():
                return _BlockContext("attention", key, mod)
            if _MLP_CLASS.search(cls):
                return _BlockContext("mlp", key, mod)
        return None

    def _model_type(self, mod_name: str) -> str | None:
        for _, mod in self._ancestors(mod_name):
            config = getattr(mod, "config", None)
            kind = getattr(config, "model_type", None)
            if isinstance(kind, str) and kind:
                return kind
        return None

    def _fail(
        self,
        name: str,
        shape,
        why: str,
        hint: str | list = "('matrix', 'row')",
        mod_name: str | None = None,
        fix: str | None = None,
    ) -> RoleInferenceError:
        pattern = re.escape(name)
        kind = self._model_type(mod_name if mod_name is not None else name.rpartition(".")[0])
        where = f" in a {kind!r} model (no convention equiopt knows settles it)" if kind else ""
        if fix is None:
            options = [hint] if isinstance(hint, str) else list(hint)
            fix = "Pass an explicit rule: " + ", or ".join(
                f"assign_roles(model, rules={{{pattern!r}: {rule}}}){f' {when}' if when else ''}"
                for rule, when in (o if isinstance(o, tuple) else (o, "") for o in options)
            )
        return RoleInferenceError(
            f"cannot infer the role of {name!r} (shape {tuple(shape)}){where}: {why}. "
            + fix
            + " (build_optimizer takes the same keyword arguments)"
        )

    def _oriented(self, module: nn.Module, attr: str, p: torch.Tensor) -> _Orientation:
        """(storage, out, in) of a 2-D weight under the hidden size in force."""
        return _orientation(module, attr, p, self.dims.hidden)

    def _matrices_in(self, block: nn.Module, p: torch.Tensor) -> Iterator[tuple[torch.Tensor, _Orientation]]:
        """The 2-D weights of ``block`` other than ``p`` (biases left out), each with how it is stored."""
        for _, sub in block.named_modules():
            for attr, q in sub.named_parameters(recurse=False):
                if q is p or q.ndim != 2 or attr.endswith("bias"):
                    continue
                yield q, self._oriented(sub, attr, q)
