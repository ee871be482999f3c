"""Infer the role and layout of every trainable parameter of a model.

Decisions come from the module structure (which module owns the parameter, its class,
the storage convention of that class), the shapes, and the model config (hidden size,
heads, head dim, experts); never from the model's name. Where a convention cannot be
determined (an unknown module storing a square matrix, a fused gate/up tensor whose
pairing is not declared and cannot be probed), inference fails with a message that says
which explicit rule would settle it.

This module holds the entry point, :func:`assign_roles`, and the order in which the
conventions are tried for one parameter; each convention lives in a module of
:mod:`equiopt.roles.inference` named after it (``attention``, ``mlp``, ``experts``,
``gate_up``, ``embeddings``, ``storage``, ``dims``, ``rules``, ...).

Conventions recognised:

- ``nn.Linear`` stores ``(out, in)``; transformers' ``Conv1D`` (GPT-2 style) stores
  ``(in, out)``; ``nn.Embedding`` rows are the vocabulary.
- transformers >= 5 expert modules declare ``is_transposed`` (``(E, in, out)`` storage)
  and ``is_concatenated`` (``[gate; up]`` rather than interleaved ``g0, u0, ...``).
- A fused dense gate/up projection (``out = 2 d_ff``) has its pairing found by running
  the MLP block and checking which pairing's neuron permutation leaves its output
  unchanged (the block's own symmetry); on the meta device this is impossible and an
  explicit rule is required.
- Convolution weights (``nn.Conv1d/2d/3d``, ``nn.ConvTranspose*``: a conv stem, a ViT
  patch embedding, a Mamba-style depthwise ``conv1d``), wherever they sit, are role
  ``matrix`` with layout ``Flatten(kernel_size, groups)``: the ``(out, in/groups x
  kernel)`` matrix the layer applies to each input patch, one block per group (a grouped
  convolution is block diagonal), so recipes give them their ``matrix`` rule (Muon in
  every built-in recipe). A depthwise convolution ``(d, 1, k)`` thus has ``d`` blocks of
  one row: the spectral rule normalises each channel's filter update (the steepest
  descent for the layer's operator norm, the largest over its channels). Transposed
  convolutions store ``(in, out/groups, *kernel)``: their rows are the input channels.
- Outside any recognised block, a tensor of more than two axes whose axes other than the
  last are all 1 (a ViT ``cls_token`` ``(1, 1, d)``) is a ``vector``; one whose first axis
  is 1 and last two are not (position embeddings ``(1, n, d)``) is a ``matrix`` with
  layout ``experts:row`` (one ``(n, d)`` work matrix). Any other tensor of more than two
  axes is an error that proposes the ``rules=`` entry (e.g. ``('matrix', 'flatten:4x4')``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..layouts import Col, Experts, Flatten, Row
from .inference.attention import _AttentionRoles
from .inference.context import _Decision
from .inference.dims import ModelDims, model_dims
from .inference.embeddings import input_embedding as input_embedding
from .inference.errors import RoleInferenceError, _nd_fix
from .inference.mlp import _MlpRoles
from .inference.model_check import _check_model, _unregistered_modules
from .inference.names import _is_bias
from .inference.rules import rule_table
from .inference.storage import CONVS, _conv, _storage
from .table import RoleRow, RoleTable

__all__ = ["assign_roles", "model_dims", "ModelDims", "RoleInferenceError"]
# rule_table, input_embedding and _CONVS stay importable from here, where they were defined before
_CONVS = CONVS


def assign_roles(
    model: nn.Module,
    rules: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
    dims: Mapping[str, Any] | None = None,
    gate_up: str = "split",
    per_head: bool = True,
    dataflow: bool = True,
) -> RoleTable:
    """One :class:`RoleRow` per trainable parameter of ``model``.

    ``model`` may be the bare model or any module that holds it: DDP (``.module``),
    FSDP2 (``fully_shard``), ``torch.compile``, a LightningModule or a user's wrapper,
    Hugging Face nesting. Roles and layouts are those of the bare model; names are those
    of ``model.named_parameters()``. Dimensions come from the nearest source in the
    module tree: the block's own attributes (``head_dim``, ``num_heads``, ...,
    ``num_experts``), then the nearest ``config`` above it, so blocks that differ keep
    their own.

    ``rules``: regex on parameter names -> role, or -> ``(role, layout)`` /
    ``{"role": ..., "layout": ...}``; the first match wins and overrides inference
    (a role without a layout gets the inferred layout of that role; a tensor of more than
    two axes that is not a convolution weight gets ``flatten`` of its trailing axes). ``dims``:
    overrides of the config dimensions for every block (``hidden``, ``heads``,
    ``kv_heads``, ``head_dim``, ``experts``, ``vocab``). ``gate_up="split"`` gives fused
    gate/up tensors one work matrix per half; ``"paired"`` keeps each neuron's gate and
    up rows together. ``per_head=False`` gives attention projections whole-matrix
    layouts; with ``per_head=True`` (default) an attention projection whose head size
    cannot be found is an error, not a silent whole-matrix fallback.

    Args:
        model: the model, bare or wrapped.
        rules: role (and layout) overrides by regex on parameter names.
        dims: dimensions for every block, overriding the config (``hidden``, ``heads``,
            ``kv_heads``, ``head_dim``, ``experts``, ``vocab``).
        gate_up: ``"split"`` or ``"paired"``, for fused gate/up tensors.
        per_head: per-head layouts for attention projections.
        dataflow: decide roles from one forward on fake tensors (the default); False
            decides from module structure, names, shapes and config alone.

    Returns:
        The :class:`RoleTable`: one row per trainable parameter, in the order of
        ``model.named_parameters()``.

    Raises:
        RoleInferenceError: where a parameter's role or layout cannot be known (the
            message names the parameter and proposes the ``rules=``, ``dims=`` or
            ``per_head=`` setting that fixes it).
        ValueError: for an unknown role in ``rules``, an unknown key in ``dims`` or a
            bad ``gate_up``.
    """
    if gate_up not in ("split", "paired"):
        raise ValueError(f"gate_up must be 'split' or 'paired', got {gate_up!r}")
    _check_model(model)
    table = rule_table(rules)
    ctx = _Context(model, dims, gate_up == "split", per_head)
    flow = _dataflow(model, gate_up == "split", per_head) if dataflow else None
    rows, notes = [], []
    if flow is not None and flow.failed:
        warnings.warn(
            f"roles: the forward of {type(model).__name__} could not run on fake tensors ({flow.failed}); "
            "roles come from module structure, names, shapes and config attributes",
            stacklevel=2,
        )
        notes.append(f"roles from names and shapes: the forward could not be traced ({flow.failed})")
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{attr}" if mod_name else attr
            forced = next((rule for rule in table if rule.pattern.search(name)), None)
            if forced is not None and forced.role != "vector" and p.ndim < 2:
                notes.append(
                    f"rule for {forced.role!r} matched the {p.ndim}-D parameter {name!r}, which stays a vector"
                )
                forced = None
            if forced is not None:
                role, layout = forced.role, forced.layout
                if layout is None and role != "vector":
                    try:
                        layout = ctx.infer(mod_name, module, attr, p, want=role).layout
                    except RoleInferenceError:
                        layout = Row() if p.ndim == 2 else None
                if layout is not None:
                    layout.check(tuple(p.shape), name)
                reason, source = "explicit rule", "rule"
            elif flow is not None and id(p) in flow.by_param:
                (role, layout, reason), source = _from_dataflow(
                    ctx, flow.by_param[id(p)], name, mod_name, module, attr, p, notes
                )
            else:
                role, layout, reason = ctx.infer(mod_name, module, attr, p)
                source = "name"
            rows.append(RoleRow(name, tuple(p.shape), role, layout, reason, p, source))
    hidden = _unregistered_modules(model)
    if hidden:
        notes.append(
            f"attribute(s) {', '.join(repr(h) for h in hidden)} of {type(model).__name__} hold modules that "
            "are not registered as submodules: their parameters are not in this table"
        )
    if ctx.probed:
        notes.append("gate/up pairing found by probing the MLP's neuron-permutation symmetry: " + ", ".join(ctx.probed))
    tied = ctx.tied or (flow is not None and flow.tied)
    return RoleTable(rows, tied_embeddings=tied, notes=notes)


def _from_dataflow(ctx, found, name, mod_name, module, attr, p, notes) -> tuple[_Decision, str]:
    """The dataflow's decision for one parameter and its source, checked against what names
    and shapes say: the dataflow wins where it saw a role (a disagreement becomes a note of
    the table); where it saw only a plain product (``matrix``) and the names give a role, the
    names' decision stands (an operation the trace does not know, e.g. an attention kernel of
    another library, hides the role from it), with a note."""
    if found.problem is not None:
        raise ctx._fail(
            name,
            p.shape,
            f"the forward shows it as {found.role!r}, but {found.problem}",
            fix=f"Pass an explicit rule, e.g. assign_roles(model, rules={{{re.escape(name)!r}: "
            f"{_suggested_rule(found.role, p)}}})",
        )
    try:
        by_name = ctx.infer(mod_name, module, attr, p)
    except RoleInferenceError:
        by_name = None
    if by_name is not None and found.role == "matrix" and by_name.role not in ("matrix", "vector"):
        notes.append(f"{name}: the forward showed no role for it; names and shapes give {by_name.role!r}")
        return by_name, "name"
    if by_name is not None and (by_name.role, by_name.layout) != (found.role, found.layout):
        notes.append(
            f"{name}: names and shapes suggest {by_name.role!r} {by_name.layout!r}; "
            f"the dataflow's {found.role!r} {found.layout!r} is used ({found.reason})"
        )
    return _Decision(found.role, found.layout, found.reason), "dataflow"


def _suggested_rule(role: str, p: torch.Tensor) -> str:
    """A ``rules=`` value that is right for ``role`` on a parameter of ``p``'s shape."""
    if p.ndim == 3:
        return repr((role, "experts:row"))
    if p.ndim > 3:
        return repr((role, "flatten:" + "x".join(map(str, p.shape[2:]))))
    return repr((role, "row"))


def _dataflow(model: nn.Module, split: bool, per_head: bool):
    from .dataflow import findings

    return findings(model, split=split, per_head=per_head)


class _Context(_AttentionRoles, _MlpRoles):
    """The inference of one model: each parameter goes to the rule of the block it sits
    in (attention, MLP or MoE) after the conventions that need no block (vectors,
    convolutions, embeddings and LM heads, explicit roles)."""

    def infer(self, mod_name: str, module: nn.Module, attr: str, p: torch.Tensor, want: str | None = None) -> _Decision:
        name = f"{mod_name}.{attr}" if mod_name else attr
        shape = tuple(p.shape)
        self.dims = self.dims_at(mod_name)
        if want is None and (p.ndim < 2 or _is_bias(attr)):
            kind = "bias" if _is_bias(attr) else ("scalar" if p.ndim == 0 else "1-D")
            return _Decision("vector", None, f"{kind} parameter: element-wise rule")
        conv = _conv(module, attr, p)
        if conv is not None:
            return _Decision(want or "matrix", conv.layout, conv.reason)
        emb = self.embeddings.get(id(p))
        if emb is not None and want in (None, "embedding"):
            return _Decision("embedding", Row(), f"input embedding {type(emb).__name__}: rows = vocabulary")
        head = self.lm_heads.get(id(p))
        if head is not None and want in (None, "lm_head"):
            if _storage(head, "weight") == "in_out":
                return _Decision("lm_head", Col(), "output embedding stored (d, vocab): work = transpose")
            return _Decision("lm_head", Row(), "output embedding: rows = vocabulary, centred by the recipe")
        ctx = self._context_of(mod_name)
        if want is not None and want not in ("attention", "mlp_in", "mlp_out", "router"):
            if p.ndim > 2:
                return _Decision(want, Flatten(shape[2:]), "")
            return _Decision(want, (Col() if _storage(module, attr) == "in_out" else Row()), "")
        if ctx is not None and ctx.kind == "mlp" or want in ("mlp_in", "mlp_out", "router"):
            found = self._mlp(name, mod_name, module, attr, p, ctx, want)
            if found is not None:
                return found
        if ctx is not None and ctx.kind == "attention" or want == "attention":
            return self._attention(name, module, attr, p, ctx.module if ctx is not None else module)
        if p.ndim == 2:
            return _Decision("matrix", Row(), "2-D weight outside attention/MLP blocks: whole matrix")
        if all(n == 1 for n in shape[:-1]):
            return _Decision(
                "vector", None, f"{'x'.join(map(str, shape))} tensor with one axis longer than 1: element-wise rule"
            )
        if p.ndim == 3 and shape[0] == 1:
            return _Decision("matrix", Experts(Row()), f"one {shape[1]}x{shape[2]} matrix behind a leading axis of 1")
        raise self._fail(name, shape, f"a {p.ndim}-D tensor outside any recognised block", fix=_nd_fix(name, shape))
