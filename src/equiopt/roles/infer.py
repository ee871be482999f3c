"""Infer the role and layout of every trainable parameter of a model.

Decisions come from the module structure (which module owns the parameter, its class,
the storage convention of that class), the shapes, and the model config (hidden size,
heads, head dim, experts); never from the model's name. Where a convention cannot be
determined (an unknown module storing a square matrix, a fused gate/up tensor whose
pairing is not declared and cannot be probed), inference fails with a message that says
which explicit rule would settle it.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from ..layouts import Col, Experts, Flatten, GateUp, Heads, Layout, Row, parse_layout
from .table import ROLES, RoleRow, RoleTable

_ATTN_CLASS = re.compile(r"attention|attn", re.I)
_MLP_CLASS = re.compile(r"mlp|feedforward|feed_forward|ffn|moe|expert", re.I)
_ROUTER_CLASS = re.compile(r"router|topk|gate$", re.I)
# attention sub-module names that mark the output projection / the input projections
_ATTN_OUT_NAMES = {"o_proj", "out_proj", "c_proj", "dense", "wo", "o", "proj", "output"}
_ATTN_IN_NAMES = {
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "c_attn",
    "query_key_value",
    "wqkv",
    "query",
    "key",
    "value",
    "q",
    "k",
    "v",
    "wq",
    "wk",
    "wv",
    "qkv",
    "in_proj",
}
_MLP_OUT_NAMES = {"down_proj", "w2", "fc2", "c_proj", "fc_out", "dense_4h_to_h", "wo", "out_proj", "down"}
_MLP_IN_NAMES = {
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "w1",
    "w3",
    "fc1",
    "c_fc",
    "fc_in",
    "dense_h_to_4h",
    "wi",
    "up",
    "gate",
    "w12",
}


class _Decision(NamedTuple):
    """What inference decided for one parameter: its role, its layout (None for a
    vector) and the reason shown in the role table."""

    role: str
    layout: Layout | None
    reason: str


class _RoleRule(NamedTuple):
    """One entry of ``rules=``: parameters whose name matches ``pattern`` get ``role`` and
    ``layout`` (None: the layout inference gives for that role)."""

    pattern: re.Pattern
    role: str
    layout: Layout | None


class _BlockContext(NamedTuple):
    """The nearest attention or MLP block around a module: ``kind`` (``"attention"`` or
    ``"mlp"``), its module path and the block module itself."""

    kind: str
    path: str
    module: nn.Module


class _Orientation(NamedTuple):
    """How a 2-D weight is stored: ``storage`` (``"out_in"``, ``"in_out"`` or ``"unknown"``)
    and the output and input widths of the map it applies."""

    storage: str
    out_features: int
    in_features: int


class _ConvLayout(NamedTuple):
    """The layout of a convolution weight and the reason that describes its axes."""

    layout: Flatten
    reason: str


class _DownProjection(NamedTuple):
    """The output projection an MLP block's fused gate/up weight is probed against."""

    weight: torch.Tensor
    storage: str


class _MlaDims(NamedTuple):
    """Head counts and sizes of a multi-head latent attention block."""

    heads: int
    qk_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int | None


def _mla_dims(block: nn.Module) -> _MlaDims | None:
    """``(heads, qk_head_dim, qk_nope_head_dim, v_head_dim, kv_lora_rank)`` of a multi-head
    latent attention block (DeepSeek V2/V3 in torchtitan and transformers), else None."""
    qk, v = _positive_int(getattr(block, "qk_head_dim", None)), _positive_int(getattr(block, "v_head_dim", None))
    heads = next(
        (h for n in ("n_heads", "num_heads", "num_attention_heads") if (h := _positive_int(getattr(block, n, None)))),
        None,
    )
    if qk is None or v is None or heads is None:
        return None
    rope = _positive_int(getattr(block, "qk_rope_head_dim", None)) or 0
    nope = _positive_int(getattr(block, "qk_nope_head_dim", None)) or qk - rope
    return _MlaDims(heads, qk, nope, v, _positive_int(getattr(block, "kv_lora_rank", None)))


class RoleInferenceError(ValueError):
    """A parameter whose role or storage convention cannot be determined."""


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
    dims = ModelDims()
    config = _first_config(model)
    if config is not None:
        _from_config(dims, config)
    emb = _input_embedding(model, dims.vocab)
    if emb is not None:
        dims.vocab = dims.vocab or emb.weight.shape[0]
        dims.hidden = dims.hidden or emb.weight.shape[1]
    return _finish(dims, overrides)


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


def _input_embedding(model: nn.Module, vocab: int | None = None):
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


def _storage(module: nn.Module, attr: str) -> str:
    """``"out_in"`` (nn.Linear), ``"in_out"`` (Conv1D) or ``"unknown"`` for a 2-D weight."""
    if isinstance(module, nn.Linear) and attr == "weight":
        return "out_in"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and attr == "weight":
        return "in_out"
    return "unknown"


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _conv(module: nn.Module, attr: str, p: torch.Tensor) -> _ConvLayout | None:
    """``(layout, reason)`` of a convolution weight, else None."""
    if not isinstance(module, _CONVS) or attr != "weight" or p.ndim < 3:
        return None
    kernel, groups = tuple(p.shape[2:]), int(getattr(module, "groups", 1) or 1)
    if p.shape[0] % groups:
        return None
    cls = type(module).__name__
    k = "x".join(map(str, kernel))
    if getattr(module, "transposed", False):
        what = f"{cls} weight (in {p.shape[0]}, out/groups {p.shape[1]}, kernel {k}): rows = input channels"
    else:
        what = f"{cls} weight (out {p.shape[0]}, in/groups {p.shape[1]}, kernel {k}): rows = output channels"
    if groups == 1:
        return _ConvLayout(Flatten(kernel), f"{what}, work = rows x (channels*kernel)")
    depthwise = " (depthwise: one filter per channel)" if p.shape[0] == groups else ""
    return _ConvLayout(Flatten(kernel, groups), f"{what}, one block per group of {groups}{depthwise}")


def _nd_fix(name: str, shape: tuple[int, ...]) -> str:
    """The ``rules=`` entries that settle a tensor of more than two axes."""
    pattern = re.escape(name)
    fold = "x".join(map(str, shape[2:]))
    work = f"({shape[0]}, {shape[1] * (torch.Size(shape[2:]).numel())})"
    stack = (
        f", {{{pattern!r}: ('matrix', 'experts:row')}} for a stack of {shape[0]} matrices {shape[1:]}"
        if len(shape) == 3
        else ""
    )
    return (
        f"Pass an explicit rule, e.g. assign_roles(model, rules={{{pattern!r}: ('matrix', 'flatten:{fold}')}}) "
        f"for one {work} work matrix (rows = the first axis; a spectral step on it, as for a convolution)"
        f"{stack}, or {{{pattern!r}: 'vector'}} for an element-wise rule"
    )


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1].lower()


# A tensor named by its axes (torchtitan's ``w1_EFD``, ``w2_EDF``, ``mlp1_weight_EGD``,
# ``mlp1_bias_EG``): one capital letter per dimension; E = experts, D = model width,
# F = FFN width, G = fused gate/up (2 F).
_AXES_SUFFIX = re.compile(r"_([A-Z]+)$")


def _axes(attr: str, ndim: int) -> str | None:
    """The axis letters a parameter's name ends with, when there is one per dimension."""
    m = _AXES_SUFFIX.search(attr)
    return m.group(1) if m is not None and len(m.group(1)) == ndim else None


def _is_bias(attr: str) -> bool:
    """``bias``, ``q_bias``, or an axis-named bias such as ``mlp1_bias_EG``."""
    return attr.endswith("bias") or bool(re.search(r"(^|_)bias_[A-Z]+$", attr))


def _rule_table(rules) -> list[_RoleRule]:
    if rules is None:
        return []
    items = rules.items() if isinstance(rules, Mapping) else rules
    table = []
    for pattern, spec in items:
        if isinstance(spec, str):
            role, layout = spec, None
        elif isinstance(spec, Mapping):
            role, layout = spec.get("role"), spec.get("layout")
        else:
            role, layout = spec
        if role not in ROLES:
            raise ValueError(f"rule {pattern!r}: unknown role {role!r}; valid: {', '.join(ROLES)}")
        table.append(_RoleRule(re.compile(pattern), role, None if layout is None else parse_layout(layout)))
    return table


def _unregistered_modules(obj: Any) -> list[str]:
    """Attributes of ``obj`` that hold modules without registering them (plain lists,
    tuples, dicts, or set past ``nn.Module.__setattr__``): their parameters are invisible."""
    found = []
    registered = getattr(obj, "_modules", {}) or {}
    for key, value in (vars(obj) if hasattr(obj, "__dict__") else {}).items():
        if key == "_modules" or key in registered:
            continue
        items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, nn.Module) and any(True for _ in v.parameters()) for v in items):
            found.append(key)
    return found


def _check_model(model: Any) -> None:
    """Clear errors for something that is not a model, or a wrapper that hides its model."""
    if not isinstance(model, nn.Module):
        inner = [k for k, v in (vars(model).items() if hasattr(model, "__dict__") else ()) if isinstance(v, nn.Module)]
        hint = (
            f"; it holds one at .{inner[0]}: pass that"
            if len(inner) == 1
            else (f"; it holds modules at {', '.join('.' + k for k in inner)}: pass the model" if inner else "")
        )
        raise TypeError(
            f"expected an nn.Module (the model, or a wrapper module holding it), got {type(model).__name__}{hint}"
        )
    if any(p.requires_grad for p in model.parameters()):
        return
    total = sum(1 for _ in model.parameters())
    hidden = _unregistered_modules(model)
    if hidden:
        raise RoleInferenceError(
            f"{type(model).__name__} reports no trainable parameters, but its attribute(s) "
            f"{', '.join(repr(h) for h in hidden)} hold modules that are not registered as submodules "
            "(a plain list, dict or tuple); pass the model itself, or register it (nn.ModuleList, nn.ModuleDict, "
            "or a plain attribute assignment) so that named_parameters() reports it"
        )
    if total:
        raise RoleInferenceError(
            f"{type(model).__name__} has {total} parameters but none requires grad: nothing to optimize"
        )
    raise RoleInferenceError(
        f"{type(model).__name__} has no parameters: the inner model cannot be found. Pass the model itself, or a "
        "wrapper that registers it as a submodule (DDP's .module, a LightningModule attribute)"
    )


def assign_roles(
    model: nn.Module,
    rules: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
    dims: Mapping[str, Any] | None = None,
    gate_up: str = "split",
    per_head: bool = True,
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
    table = _rule_table(rules)
    ctx = _Context(model, dims, gate_up == "split", per_head)
    rows, notes = [], []
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
                reason = "explicit rule"
            else:
                role, layout, reason = ctx.infer(mod_name, module, attr, p)
            rows.append(RoleRow(name, tuple(p.shape), role, layout, reason, p))
    hidden = _unregistered_modules(model)
    if hidden:
        notes.append(
            f"attribute(s) {', '.join(repr(h) for h in hidden)} of {type(model).__name__} hold modules that "
            "are not registered as submodules: their parameters are not in this table"
        )
    if ctx.probed:
        notes.append("gate/up pairing found by probing the MLP's neuron-permutation symmetry: " + ", ".join(ctx.probed))
    return RoleTable(rows, tied_embeddings=ctx.tied, notes=notes)


class _Context:
    def __init__(self, model: nn.Module, overrides: Mapping[str, Any] | None, split: bool, per_head: bool):
        self.model, self.split, self.per_head = model, split, per_head
        self.overrides = dict(overrides or {})
        _finish(ModelDims(), self.overrides)  # unknown keys fail here, before any inference
        self.modules = dict(model.named_modules())
        # dimensions no block or config gives: hidden size and vocabulary from the embedding
        self.fallback = ModelDims()
        config = _first_config(model)
        if config is not None:
            _from_config(self.fallback, config)
        emb = _input_embedding(model, self.fallback.vocab)
        if emb is not None and getattr(emb, "weight", None) is not None and emb.weight.ndim == 2:
            self.fallback.vocab = self.fallback.vocab or emb.weight.shape[0]
            self.fallback.hidden = self.fallback.hidden or emb.weight.shape[1]
        self._dims: dict[str, ModelDims] = {}
        self.dims = self.dims_at("")  # the dimensions in force for the parameter being inferred
        self.embeddings: dict[int, nn.Module] = {}
        self.lm_heads: dict[int, nn.Module] = {}
        self.tied = False
        owners = _embedding_owners(model) or [("", model)]
        for owner_name, owner in owners:
            emb = _call(owner, "get_input_embeddings") or _input_embedding(owner, self.dims_at(owner_name).vocab)
            out = _output_embedding(owner, self.dims_at(owner_name))
            for module, found in ((emb, self.embeddings), (out, self.lm_heads)):
                w = getattr(module, "weight", None) if module is not None else None
                if isinstance(w, torch.Tensor):
                    found[id(w)] = module
            if emb is not None and out is not None and getattr(out, "weight", None) is getattr(emb, "weight", 0):
                self.tied = True
        self.probed: list[str] = []

    # ----------------------------------------------------------------- helpers
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
        hint: str = "('mlp_in', 'row')",
        mod_name: str | None = None,
        fix: str | None = None,
    ) -> RoleInferenceError:
        pattern = re.escape(name)
        kind = self._model_type(mod_name if mod_name is not None else name.rpartition(".")[0])
        where = f" in a {kind!r} model (no convention equiopt knows settles it)" if kind else ""
        return RoleInferenceError(
            f"cannot infer the role of {name!r} (shape {tuple(shape)}){where}: {why}. "
            + (fix or f"Pass an explicit rule, e.g. assign_roles(model, rules={{{pattern!r}: {hint}}})")
            + " (build_optimizer takes the same keyword arguments)"
        )

    # --------------------------------------------------------------- inference
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

    def _oriented(self, name, module, attr, p) -> _Orientation:
        """(storage, out, in) of a 2-D weight; storage may be 'unknown' (then shapes decide)."""
        st = _storage(module, attr)
        a, b = p.shape[-2], p.shape[-1]
        if st == "in_out":
            return _Orientation(st, b, a)
        if st == "out_in":
            return _Orientation(st, a, b)
        hidden = self.dims.hidden
        if hidden is not None and b == hidden and a != hidden:
            return _Orientation("out_in", a, b)
        if hidden is not None and a == hidden and b != hidden:
            return _Orientation("in_out", b, a)
        return _Orientation("unknown", a, b)

    def _attention(self, name, module, attr, p, block):
        d = self.dims
        if p.ndim != 2:
            raise self._fail(
                name,
                p.shape,
                "a non-matrix tensor in an attention block",
                fix=_nd_fix(name, tuple(p.shape)) if p.ndim > 2 else None,
            )
        st, out, inp = self._oriented(name, module, attr, p)
        hd = d.head_dim
        where = type(block).__name__
        if not self.per_head:
            return _Decision("attention", Row(), f"{where} projection: whole matrix (per_head=False)")
        mla = _mla_dims(block)
        if mla is not None:
            return self._mla(where, st, out, inp, mla)
        if hd is None:
            raise self._fail(
                name,
                p.shape,
                f"no head size found for {where} (no head_dim / num_heads on the block, nor a config "
                "with head_dim or num_attention_heads and hidden_size in the module tree)",
                fix="Give the dimensions, e.g. assign_roles(model, dims={'head_dim': ...}) or dims={'heads': ..., "
                "'hidden': ...}, or per_head=False for whole-matrix attention, or an explicit rule "
                f"rules={{{re.escape(name)!r}: ('attention', 'heads:<head_dim>')}}",
            )
        short = _short(name.rsplit(".", 1)[0]) if "." in name else ""
        input_side = inp == d.hidden and out % hd == 0
        output_side = out == d.hidden and inp % hd == 0
        if st == "unknown" and input_side and output_side:
            raise self._fail(name, p.shape, f"square weight in {where} with unknown storage convention")
        if input_side and output_side:
            if short in _ATTN_OUT_NAMES:
                input_side = False
            elif short in _ATTN_IN_NAMES:
                output_side = False
            else:
                raise self._fail(name, p.shape, "square attention projection: cannot tell q/k/v from output")
        heads = None
        if input_side:
            heads = out // hd
            layout = Heads(hd) if st == "out_in" else Heads(hd, "cols")
            fused = d.heads is not None and out == (d.heads + 2 * (d.kv_heads or d.heads)) * hd
            kind = "fused q/k/v" if fused else "q/k/v"
            return _Decision(
                "attention",
                layout,
                f"{where} {kind} projection ({inp} -> {out}): {heads} blocks of {hd} rows, one per head",
            )
        if output_side:
            heads = inp // hd
            layout = Heads(hd, "cols") if st == "out_in" else Heads(hd)
            return _Decision(
                "attention",
                layout,
                f"{where} output projection ({inp} -> {out}): {heads} blocks of {hd} columns, one per head",
            )
        return _Decision("attention", Row(), f"{where} projection ({inp} -> {out}) not split by heads: whole matrix")

    def _mla(self, where, st, out, inp, mla):
        """Multi-head latent attention (DeepSeek V2/V3): the query and the key/value
        up-projections have a block of rows per head, the output projection a block of
        columns per head; the latent down-projections have no head axis."""
        heads, qk, nope, v, kv_rank = mla
        rows = (lambda size: Heads(size)) if st != "in_out" else (lambda size: Heads(size, "cols"))
        if out == heads * (nope + v) and (kv_rank is None or inp == kv_rank):
            if nope == v:
                return _Decision(
                    "attention",
                    rows(v),
                    f"{where} key/value up-projection ({inp} -> {out}): {2 * heads} "
                    f"blocks of {v} rows, a key and a value block per head",
                )
            return _Decision(
                "attention",
                rows(nope + v),
                f"{where} key/value up-projection ({inp} -> {out}): {heads} blocks of {nope + v} rows, one per head",
            )
        if out == heads * qk:
            return _Decision(
                "attention",
                rows(qk),
                f"{where} query projection ({inp} -> {out}): {heads} blocks of {qk} rows, one per head",
            )
        if inp == heads * v and out == self.dims.hidden:
            layout = Heads(v, "cols") if st != "in_out" else Heads(v)
            return _Decision(
                "attention",
                layout,
                f"{where} output projection ({inp} -> {out}): {heads} blocks of {v} columns, one per head",
            )
        return _Decision("attention", Row(), f"{where} latent projection ({inp} -> {out}): no head axis, whole matrix")

    def _mlp(self, name, mod_name, module, attr, p, ctx, want):
        d = self.dims
        block = ctx.module if ctx is not None else module
        where = type(block).__name__
        shape = tuple(p.shape)
        # router: (experts, hidden) in an MoE block, or a module whose class says so
        if p.ndim == 2 and want in (None, "router"):
            is_router_cls = bool(_ROUTER_CLASS.search(type(module).__name__)) and not isinstance(module, nn.Embedding)
            e = d.experts
            if (
                (e is not None and d.hidden is not None and e != d.hidden and shape in ((e, d.hidden), (d.hidden, e)))
                or (is_router_cls and want is None and (d.experts is None or d.experts in shape))
                or want == "router"
            ):
                rows_first = d.hidden is None or shape[-1] == d.hidden
                layout = Row() if rows_first else Col()
                return _Decision("router", layout, f"router of {where}: rows = experts, centred by the recipe")
        if p.ndim == 3:
            return self._experts(name, module, attr, p, where)
        if p.ndim != 2:
            return None
        st, out, inp = self._oriented(name, module, attr, p)
        if min(out, inp) == 1:  # a per-token scalar gate (e.g. a shared expert's gate): no neuron axis
            return _Decision("matrix", Row(), f"{where} scalar gate ({inp} -> {out}): whole matrix")
        short = _short(mod_name) if mod_name else ""
        if inp == d.hidden and out != d.hidden:
            side = "in"
        elif out == d.hidden and inp != d.hidden:
            side = "out"
        elif short in _MLP_OUT_NAMES or want == "mlp_out":
            side = "out"
        elif short in _MLP_IN_NAMES or want == "mlp_in":
            side = "in"
        else:
            raise self._fail(name, shape, f"square weight in {where}: cannot tell input from output projection")
        if st == "unknown" and inp == out:
            raise self._fail(name, shape, f"weight in {where} with unknown storage convention")
        if side == "out":
            layout = Col() if st == "out_in" else Row()
            return _Decision("mlp_out", layout, f"{where} output projection ({inp} -> {out}): work = neurons x hidden")
        ff_out = self._sibling_ff(block, p)
        if ff_out is not None and out == 2 * ff_out:
            mode = self._probe_pairing(name, block, module, attr, p, st)
            layout = GateUp(mode, split=self.split, axis=0 if st == "out_in" else 1)
            return _Decision("mlp_in", layout, f"{where} fused gate/up ({mode}), {ff_out} neurons: work rows = neurons")
        layout = Row() if st == "out_in" else Col()
        return _Decision("mlp_in", layout, f"{where} input projection ({inp} -> {out}): rows = neurons")

    def _sibling_ff(self, block: nn.Module, p) -> int | None:
        """Neuron count of the block's output projection (its input width), if it has one."""
        for sub_name, sub in block.named_modules():
            for attr, q in sub.named_parameters(recurse=False):
                if q is p or q.ndim != 2 or attr.endswith("bias"):
                    continue
                oriented = self._oriented(sub_name, sub, attr, q)
                if oriented.out_features == self.dims.hidden and oriented.in_features != self.dims.hidden:
                    return oriented.in_features
        return None

    def _experts(self, name, module, attr, p, where):
        d = self.dims
        E, a, b = p.shape
        transposed = getattr(module, "is_transposed", None)
        axes = _axes(attr, 3)
        named = transposed is None and axes is not None and axes[0] == "E" and axes[1:].count("D") == 1
        if named:  # axis-named stacks (w1_EFD, w2_EDF) are stored (experts, out, in), as nn.Linear stores a matrix
            transposed = False
        elif transposed is None:
            if b == d.hidden and a != d.hidden:
                transposed = False
            elif a == d.hidden and b != d.hidden:
                transposed = True
            else:
                raise self._fail(name, p.shape, f"expert tensor in {type(module).__name__} with undeclared storage")
        out, inp = (b, a) if transposed else (a, b)
        if named:  # the axis that is the model width tells the side, whatever the sizes
            side = "in" if axes[2] == "D" else "out"
        elif out == d.hidden and inp == d.hidden:  # square experts: the tensor's name decides
            side = (
                "out"
                if "down" in attr or attr.endswith(("w2", "wo"))
                else ("in" if "gate" in attr or "up" in attr else None)
            )
            if side is None:
                raise self._fail(name, p.shape, "square expert tensor: cannot tell input from output projection")
        else:
            side = "out" if out == d.hidden else ("in" if inp == d.hidden else None)
        if side is None:
            raise self._fail(name, p.shape, "expert tensor that neither reads nor writes the hidden size")
        if side == "out":
            inner = Row() if transposed else Col()
            return _Decision(
                "mlp_out", Experts(inner), f"{E} experts' output projections ({inp} -> {out}): neurons x hidden each"
            )
        gated = getattr(module, "has_gate", None)
        if gated is None:
            gated = "gate" in attr or (named and "G" in axes)
        if gated:
            concatenated = getattr(module, "is_concatenated", None)
            if concatenated is None:
                raise self._fail(
                    name,
                    p.shape,
                    f"fused gate/up experts in {type(module).__name__} do not declare "
                    "whether gate and up are concatenated or interleaved",
                    "('mlp_in', 'experts:gate_up:concat')",
                )
            mode = "concat" if concatenated else "interleave"
            layout = Experts(GateUp(mode, split=self.split, axis=1 if transposed else 0))
            return _Decision(
                "mlp_in", layout, f"{E} experts' fused gate/up ({mode}{', stored (in, out)' if transposed else ''})"
            )
        inner = Col() if transposed else Row()
        return _Decision("mlp_in", Experts(inner), f"{E} experts' input projections ({inp} -> {out})")

    def _probe_pairing(self, name, block, module, attr, p, st) -> str:
        """Which gate/up pairing makes a neuron permutation leave the block's output unchanged."""
        if p.device.type == "meta":
            raise self._fail(
                name,
                p.shape,
                "fused gate/up pairing cannot be probed on the meta device",
                "('mlp_in', 'gate_up:concat') or ('mlp_in', 'gate_up:interleave')",
            )
        ff = p.shape[0 if st == "out_in" else 1] // 2
        down = None
        for sub_name, sub in block.named_modules():
            for a2, q in sub.named_parameters(recurse=False):
                if q is not p and q.ndim == 2 and not a2.endswith("bias"):
                    oriented = self._oriented(sub_name, sub, a2, q)
                    if oriented.in_features == ff and oriented.out_features == self.dims.hidden:
                        down = _DownProjection(q, oriented.storage)
        if down is None:
            raise self._fail(name, p.shape, "fused gate/up without a matching output projection to probe with")
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(2, 3, self.dims.hidden, generator=g).to(device=p.device, dtype=p.dtype)
        perm = torch.randperm(ff, generator=g).to(p.device)
        results = {}
        bias = getattr(module, "bias", None) if attr == "weight" else None
        bias = bias if isinstance(bias, torch.Tensor) and bias.shape == (2 * ff,) else None
        with torch.no_grad():
            base = _first(block(x))
            saved_p, saved_q = p.detach().clone(), down.weight.detach().clone()
            saved_b = bias.detach().clone() if bias is not None else None
            for mode in ("concat", "interleave"):
                rows = (
                    torch.cat([perm, perm + ff])
                    if mode == "concat"
                    else torch.stack([2 * perm, 2 * perm + 1], 1).flatten()
                )
                if st == "out_in":
                    p.copy_(saved_p[rows])
                else:
                    p.copy_(saved_p[:, rows])
                if bias is not None:
                    bias.copy_(saved_b[rows])
                if down.storage == "out_in":
                    down.weight.copy_(saved_q[:, perm])
                else:
                    down.weight.copy_(saved_q[perm])
                moved = _first(block(x))
                results[mode] = torch.allclose(moved, base, rtol=1e-4, atol=1e-5 * float(base.abs().max()) + 1e-7)
                p.copy_(saved_p)
                down.weight.copy_(saved_q)
                if bias is not None:
                    bias.copy_(saved_b)
        good = [m for m, ok in results.items() if ok]
        if len(good) != 1:
            raise self._fail(name, p.shape, f"probing the gate/up pairing was inconclusive ({results})")
        (pairing,) = good
        self.probed.append(f"{name}: {pairing}")
        return pairing


def _first(out):
    if isinstance(out, (tuple, list)):
        return out[0]
    return out
