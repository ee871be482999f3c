"""One forward of a model on fake tensors, recording what each parameter's value flows into.

The model runs on :class:`~torch._subclasses.fake_tensor.FakeTensorMode` tensors (no memory,
no weights read, real widths) on a small token batch, with every module hook switched off
(FSDP2, TP and DDP hooks would communicate). A ``TorchDispatchMode`` above the fake mode
follows two kinds of provenance:

- a *parameter view*: a tensor that is a view of a parameter carries a meta "shadow" of it
  (a strided view of a meta tensor shaped like the parameter), so at a product the engine
  knows which parameter axis becomes the output features and which is contracted;
- a *tag* on an activation: the output of a projection by parameter ``p`` carries, for
  every element, the index along ``p``'s output-feature axis it came from (a small int64
  CPU "companion" tensor of the activation's shape, ``-1`` where the element does not come
  from ``p``); attention outputs carry each element's ``head * head_dim + j``; views,
  element-wise operations and concatenations move companions as they move the values.

What the forward shows is kept as :class:`Evidence`: token lookups, products (which
parameter, which of its axes, what tags their activation input carried), the q/k/v inputs
of attention (SDPA or matmul-softmax-matmul), gated products ``act(a) * b``, top-k over
a projection's outputs, and the projection that makes the model's output.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = [
    "Tag",
    "Product",
    "AttentionUse",
    "GatedUse",
    "Evidence",
    "TraceFailed",
    "trace_model",
    "register_trace_forward",
]

aten = torch.ops.aten

#: element-wise non-linearities that make a projection's output "activated".
_ACTIVATIONS = {
    "silu",
    "gelu",
    "relu",
    "sigmoid",
    "tanh",
    "softplus",
    "elu",
    "mish",
    "hardswish",
    "hardsigmoid",
    "leaky_relu",
    "celu",
    "selu",
    "glu",
    "relu6",
    "hardtanh",
    "log_sigmoid_forward",
}
_PROBS = {"_softmax", "softmax", "_log_softmax", "sigmoid", "_safe_softmax"}
_SDPA = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "scaled_dot_product_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
}
_COPIES = {"clone", "contiguous", "_to_copy", "detach", "alias", "lift_fresh", "lift_fresh_copy", "to", "_unsafe_view"}
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "matmul", "linear", "addbmm"}


class TraceFailed(RuntimeError):
    """The forward could not run on fake tensors; the message says where and why."""


@dataclass
class Tag:
    """Provenance of an activation: ``kind`` is ``"proj"`` (output of parameter ``pid``'s
    projection; ``comp`` holds the index along its output-feature axis), ``"attn"``
    (attention output; ``comp`` holds ``head * head_dim + j``, ``head_dim`` = ``size``) or
    ``"scores"`` (``q @ k^T`` of two tagged operands, before the softmax). ``act``: a
    non-linearity was applied; ``gated``: the result of ``act(a) * b``."""

    kind: str
    pid: int
    comp: torch.Tensor
    act: bool = False
    gated: bool = False
    size: int = 0
    probs: bool = False
    parts: tuple = ()

    def key(self) -> tuple:
        return (self.kind, self.pid, self.act, self.gated)


@dataclass
class Product:
    """A product with a parameter view as one operand: ``out_axis`` / ``in_axis`` are the
    parameter axes walked by the output features and by the contraction (each ``(axis,
    block)``: ``block > 1`` means the view walks whole blocks of that many entries along the
    axis), ``batch_axis`` likewise for a batched product's batch dimension (``None`` if
    there is none or it is a gather of experts). ``inputs``: the activation's tags, each
    with the parameter contraction coordinate of every contracted element (``coords``)."""

    pid: int
    out_axis: tuple[int, int] | None
    in_axis: tuple[int, int] | None
    batch_axis: tuple[int, int] | None
    gathered: bool
    view_shape: tuple[int, ...]
    inputs: list[tuple[Tag, torch.Tensor]] = field(default_factory=list)
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # parameter axis -> [start, stop) covered


@dataclass
class AttentionUse:
    """Rows of parameter ``pid`` that became one of attention's ``which`` (``q``/``k``/``v``)
    inputs: ``heads`` is ``(heads, head_dim)`` of output-feature indices (``-1``: not from it)."""

    pid: int
    which: str
    heads: torch.Tensor


@dataclass
class GatedUse:
    """``act(gate) * up``: the output-feature indices of ``gate_pid`` and ``up_pid`` paired."""

    gate_pid: int
    gate: torch.Tensor
    up_pid: int
    up: torch.Tensor


@dataclass
class Evidence:
    """What one forward showed, by parameter index (see :func:`trace_model`)."""

    params: list[nn.Parameter]
    lookups: set[int] = field(default_factory=set)
    positions: set[int] = field(default_factory=set)
    gathers: set[int] = field(default_factory=set)
    products: list[Product] = field(default_factory=list)
    attention: list[AttentionUse] = field(default_factory=list)
    gated: list[GatedUse] = field(default_factory=list)
    topk: set[int] = field(default_factory=set)
    logits: list[Tag] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _name(func) -> str:
    return func._schema.name.split("::")[-1]


def _is_view(func) -> bool:
    return bool(func._schema.returns) and any(
        r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns
    )


def _axis_of(shadow: torch.Tensor, dim: int, base_shape, base_strides) -> tuple[int, int] | None:
    """The parameter axis a shadow dimension walks, and the block it steps by (``None`` for
    a dimension of size 1 or stride 0)."""
    if shadow.shape[dim] == 1 or shadow.stride(dim) == 0:
        return None
    stride = shadow.stride(dim)
    for axis, (n, s) in enumerate(zip(base_shape, base_strides)):
        if stride % s == 0 and stride < s * n:
            return axis, stride // s
    return None


def _coords(shadow: torch.Tensor, dim: int, axis: int, base_shape, base_strides) -> torch.Tensor:
    """Coordinate along parameter ``axis`` of each entry of shadow dimension ``dim`` (others at 0)."""
    n = shadow.shape[dim]
    pos = shadow.storage_offset() + torch.arange(n) * shadow.stride(dim)
    return (pos // base_strides[axis]) % base_shape[axis]


class _Recorder(TorchDispatchMode):
    """The dispatch mode of :func:`trace_model` (above the fake mode)."""

    def __init__(self, evidence: Evidence, fakes: dict[int, int], tokens_per_sequence: int = 8):
        super().__init__()
        self.tokens_per_sequence = tokens_per_sequence
        self.ev = evidence
        self.fakes = fakes  # id(fake param) -> parameter index
        self.shadows: Any = WeakTensorKeyDictionary()  # tensor -> (pid, meta shadow, gathered)
        self.tags: Any = WeakTensorKeyDictionary()  # tensor -> list[Tag]
        self.tokens: Any = WeakTensorKeyDictionary()
        self.bases: dict[int, torch.Tensor] = {}

    # -- provenance lookup ------------------------------------------------------------
    def shadow(self, t) -> tuple[int, torch.Tensor, bool, tuple[int, ...]] | None:
        """``(parameter index, meta shadow, gathered, shape of the shadow's base)`` of a
        parameter view, else None."""
        if not isinstance(t, torch.Tensor):
            return None
        pid = self.fakes.get(id(t))
        if pid is not None:
            if pid not in self.bases:
                p = self.ev.params[pid]
                self.bases[pid] = torch.empty(tuple(p.shape), device="meta")
            return pid, self.bases[pid], False, tuple(self.bases[pid].shape)
        return self.shadows.get(t)

    def tags_of(self, t) -> list[Tag]:
        if not isinstance(t, torch.Tensor):
            return []
        return self.tags.get(t, [])

    # -- dispatch --------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name == "_grouped_mm":
            out = _grouped_mm_fake(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        try:
            with _real_tensors():
                self.record(func, name, args, kwargs, out)
        except Exception as err:  # provenance is best effort: a failed record loses tags, not the forward
            self.ev.skipped.append(f"{name}: {type(err).__name__}: {err}")
        return out

    def record(self, func, name, args, kwargs, out) -> None:
        first = args[0] if args else None
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if name == "embedding":
            src = self.shadow(args[0])
            if src is not None:
                by_tokens = self.tokens.get(args[1]) is not None
                (self.ev.lookups if by_tokens else self.ev.positions).add(src[0])
                if by_tokens:  # the residual stream starts here
                    self.tags[outs[0]] = [Tag("stream", -1, torch.zeros(tuple(outs[0].shape), dtype=torch.int64))]
            return
        if name in ("index", "index_select") and (src := self.shadow(first)) is not None:
            idx = args[1] if name == "index" else args[2]
            idx_list = idx if isinstance(idx, (list, tuple)) else [idx]
            if any(self.tokens.get(i) is not None for i in idx_list if isinstance(i, torch.Tensor)):
                self.ev.lookups.add(src[0])
            else:
                self.ev.gathers.add(src[0])
                trailing = tuple(self.ev.params[src[0]].shape[1:])
                lead = tuple(outs[0].shape[: outs[0].ndim - len(trailing)])
                rows = int(torch.Size(lead).numel())
                gathered = torch.empty((rows, *trailing), device="meta")  # axis 0: the gathered experts
                self.shadows[outs[0]] = (src[0], gathered.view(*lead, *trailing), True, tuple(gathered.shape))
            return
        if name in _MATMULS:
            self.product(name, args, outs[0])
            return
        if name == "copy_" and len(args) >= 2 and self.tags_of(args[1]):
            self.write_into(args[0], args[1])
            return
        if name in _SDPA:
            self.sdpa(args, outs[0])
            return
        if _looks_like_attention(name, args) and outs:
            self.foreign_attention(args, outs[0])
            return
        if name == "topk":
            for tag in self.tags_of(first):
                if tag.kind == "proj":
                    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
                    if dim in (-1, first.ndim - 1):
                        self.ev.topk.add(tag.pid)
            return
        # parameter views follow the same view on the shadow
        src = self.shadow(first)
        if src is not None and (_is_view(func) or name in _COPIES):
            pid, shadow, gathered, base_shape = src
            try:
                new = shadow if name in _COPIES and name != "_unsafe_view" else None
                if name == "_unsafe_view":
                    new = aten.view.default(shadow, *args[1:])
                if new is None:
                    new = func(shadow, *args[1:], **kwargs)
            except Exception:
                return
            for o, s in zip(outs, new if isinstance(new, (list, tuple)) else [new]):
                if isinstance(s, torch.Tensor):
                    self.shadows[o] = (pid, s, gathered, base_shape)
            return
        # activations: companions follow the values
        self.follow(func, name, args, kwargs, outs)

    def follow(self, func, name, args, kwargs, outs) -> None:
        if not outs:
            return
        tensor_args = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if any(self.tokens.get(a) is not None for a in tensor_args) and outs[0].dtype in (torch.int64, torch.int32):
            self.tokens[outs[0]] = True
        tagged = [a for a in tensor_args if self.tags_of(a)]
        if not tagged:
            return
        first = args[0] if args else None
        if name in ("view_as_complex", "view_as_real") and self.tags_of(first):
            for tag in self.tags_of(first):  # a complex companion packs the pair's two indices in one integer
                c = tag.comp
                if name == "view_as_complex":
                    packed = c[..., 0] + (c[..., 1] << 32)
                else:
                    packed = torch.stack([((c << 32) >> 32), c >> 32], -1)
                self.tags.setdefault(outs[0], []).append(_with(tag, packed))
            return
        viewing = _is_view(func) or name in ("_unsafe_view", "clone", "contiguous", "_to_copy", "alias", "detach")
        if viewing and isinstance(first, torch.Tensor) and self.tags_of(first):
            for tag in self.tags_of(first):
                comps = _apply_view(func, tag.comp, args, kwargs)
                if comps is None:
                    continue
                for o, c in zip(outs, comps):
                    self.tags.setdefault(o, []).append(_with(tag, c))
            return
        if name == "cat":
            self.cat(args, kwargs, outs[0])
            return
        if name in _MOVES and isinstance(first, torch.Tensor) and self.tags_of(first):
            moved = [(tag, _apply_same(func, tag.comp, args, kwargs)) for tag in self.tags_of(first)]
            if all(c is not None and tuple(c.shape) == tuple(outs[0].shape) for _, c in moved):
                self.tags[outs[0]] = [_with(tag, c) for tag, c in moved]
                return
        if name == "stack":
            return
        out = outs[0]
        if name == "mul" and len(args) >= 2 and self.gate(args[0], args[1], out):
            return
        if name == "addcmul" and len(args) >= 3 and self.gate(args[1], args[2], out):
            return
        merged: dict[tuple, Tag] = {}
        keys = [{t.key() for t in self.tags_of(a)} for a in tagged]
        residual = (
            name in ("add", "sub", "add_", "sub_")
            and len(args) >= 2
            and all(isinstance(a, torch.Tensor) and self.shadow(a) is None for a in args[:2])
            and any(t.kind == "stream" for a in args[:2] for t in self.tags_of(a))
            and tuple(args[0].shape) == tuple(args[1].shape)
        )
        for a in tagged:
            for tag in self.tags_of(a):
                if tag.comp.shape != a.shape:
                    continue
                try:
                    comp = tag.comp.expand(out.shape) if tuple(a.shape) != tuple(out.shape) else tag.comp
                except RuntimeError:
                    comp = _by_feature(tag.comp, tuple(out.shape))  # rows gathered, scattered or padded
                    if comp is None:
                        continue
                if residual and tag.kind == "proj" and not tag.gated and sum(tag.key() in k for k in keys) < 2:
                    continue  # a sum with an independent stream (the residual): no longer this projection's output
                new = _with(tag, comp)
                if name in _ACTIVATIONS and tag.kind == "proj":
                    new.act = True
                if name in _PROBS:
                    new.probs = True
                key = new.key()
                if key in merged:
                    old = merged[key]
                    old.comp = torch.where(old.comp >= 0, old.comp, new.comp)
                else:
                    merged[key] = new
        if merged:
            self.tags[out] = list(merged.values())[:16]

    def gate(self, a, b, out) -> bool:
        """``act(x) * y`` with the two operands from different output features: a gated activation."""
        for x, y in ((a, b), (b, a)):
            for tx in self.tags_of(x):
                if tx.kind != "proj" or not tx.act or tx.gated:
                    continue
                for ty in self.tags_of(y):
                    if ty.kind != "proj" or ty.act or ty.gated or tuple(x.shape) != tuple(y.shape):
                        continue
                    if ty.pid == tx.pid and torch.equal(ty.comp, tx.comp):
                        continue
                    self.ev.gated.append(GatedUse(tx.pid, _first_row(tx.comp), ty.pid, _first_row(ty.comp)))
                    self.tags[out] = [
                        Tag("proj", tx.pid, tx.comp.expand(out.shape), act=True, gated=True),
                        Tag("proj", ty.pid, ty.comp.expand(out.shape), act=True, gated=True),
                    ]
                    return True
        return False

    def write_into(self, dst, src) -> None:
        """``dst.copy_(src)`` where ``dst`` may be a view (a slice of a tensor the model filled
        piece by piece): ``src``'s companions are written where ``dst`` lies in its base."""
        base = dst._base if dst._base is not None else dst
        if not base.is_contiguous() or base.storage_offset() != 0:
            return
        merged = {t.key(): t for t in self.tags_of(base)}
        for tag in self.tags_of(src):
            if tag.comp.shape != src.shape:
                continue
            old = merged.get(tag.key())
            comp = old.comp.clone() if old is not None else torch.full(tuple(base.shape), -1, dtype=torch.int64)
            comp.as_strided(tuple(dst.shape), dst.stride(), dst.storage_offset()).copy_(tag.comp.expand(dst.shape))
            merged[tag.key()] = _with(tag, comp)
        self.tags[base] = list(merged.values())
        self.tags[dst] = [_with(t, t.comp.expand(dst.shape)) for t in self.tags_of(src) if t.comp.shape == src.shape]

    def cat(self, args, kwargs, out) -> None:
        tensors = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        keys: dict[tuple, Tag] = {}
        for t in tensors:
            for tag in self.tags_of(t):
                keys.setdefault(tag.key(), tag)
        merged = []
        for key, proto in keys.items():
            pieces = []
            for t in tensors:
                found = next((g for g in self.tags_of(t) if g.key() == key), None)
                if t.ndim == 1 and t.numel() == 0:
                    continue
                pieces.append(found.comp if found is not None else torch.full(tuple(t.shape), -1, dtype=torch.int64))
            merged.append(_with(proto, torch.cat(pieces, dim)))
        if merged:
            self.tags[out] = merged

    def product(self, name, args, out) -> None:
        if name in ("addmm", "baddbmm", "addbmm"):
            a, b = args[1], args[2]
        else:
            a, b = args[0], args[1]
        sa, sb = self.shadow(a), self.shadow(b)
        if sb is not None and sa is None:
            act, (pid, shadow, gathered, base_shape), right = a, sb, True
        elif sa is not None and sb is None:
            act, (pid, shadow, gathered, base_shape), right = b, sa, False
        else:
            if sa is None and sb is None:
                self.activation_product(name, a, b, out)
            return
        base_strides = _contiguous_strides(base_shape)
        nd = shadow.ndim
        out_dim, in_dim = (nd - 1, nd - 2) if right else (nd - 2, nd - 1)
        batch_dim = 0 if nd == 3 else None
        out_axis = _axis_of(shadow, out_dim, base_shape, base_strides)
        in_axis = _axis_of(shadow, in_dim, base_shape, base_strides)
        batch_axis = _axis_of(shadow, batch_dim, base_shape, base_strides) if batch_dim is not None else None
        used = {a[0] for a in (out_axis, in_axis, batch_axis) if a is not None}
        units = [k for k, n in enumerate(base_shape) if n == 1 and k not in used]
        if out_axis is None and shadow.shape[out_dim] == 1 and units:
            out_axis = (units.pop(0), 1)
        if in_axis is None and shadow.shape[in_dim] == 1 and units:
            in_axis = (units.pop(0), 1)
        prod = Product(pid, out_axis, in_axis, batch_axis, gathered, tuple(shadow.shape))
        if batch_dim is None and not gathered:
            for dim, axis in ((out_dim, out_axis), (in_dim, in_axis)):
                if axis is not None and axis[1] == 1:
                    c = _coords(shadow, dim, axis[0], base_shape, base_strides)
                    prod.spans[axis[0]] = (int(c.min()), int(c.max()) + 1)
        self.ev.products.append(prod)
        if in_axis is not None:
            in_coords = _coords(shadow, in_dim, in_axis[0], base_shape, base_strides)
            for tag in self.tags_of(act):
                c = tag.comp.movedim(-1 if right else -2, -1)  # the activation's contracted axis last
                if c.numel() == 0:
                    continue
                vec = c.reshape(-1, c.shape[-1])[0]
                if vec.numel() == in_coords.numel():
                    prod.inputs.append((tag, torch.stack([vec, in_coords])))
        if out_axis is not None:
            coords = _coords(shadow, out_dim, out_axis[0], base_shape, base_strides)
            if right:
                comp = coords.expand(tuple(out.shape))
            else:
                comp = coords.reshape(-1, 1).expand(tuple(out.shape))
            self.tags[out] = [Tag("proj", pid, comp)]

    def activation_product(self, name, a, b, out) -> None:
        """``q @ k^T`` then ``softmax(.) @ v``: attention written out."""
        ta, tb = self.tags_of(a), self.tags_of(b)
        scores = [t for t in ta if t.kind == "scores" and t.probs]
        if scores:
            q_tags, k_tags = scores[0].parts
            self.attention_event(q_tags, k_tags, [(t, t.comp) for t in tb if t.kind == "proj"], out, b)
            return
        qa = [(t, t.comp) for t in ta if t.kind == "proj"]
        kb = [(t, t.comp.transpose(-2, -1)) for t in tb if t.kind == "proj"]
        if qa and kb and out.ndim >= 3:
            marker = torch.zeros(tuple(out.shape), dtype=torch.int64)
            self.tags[out] = [Tag("scores", -1, marker, parts=(qa, kb))]

    def sdpa(self, args, out) -> None:
        q, k, v = args[0], args[1], args[2]
        self.attention_event(
            [(t, t.comp) for t in self.tags_of(q) if t.kind == "proj"],
            [(t, t.comp) for t in self.tags_of(k) if t.kind == "proj"],
            [(t, t.comp) for t in self.tags_of(v) if t.kind == "proj"],
            out,
            v,
        )

    def foreign_attention(self, args, out) -> None:
        """An attention kernel whose layout is not known: ``(batch, heads, tokens, head_dim)``
        or ``(batch, tokens, heads, head_dim)``, told apart by the trace's token count; when
        both fit, nothing is recorded (the names decide)."""
        tokens, q = self.tokens_per_sequence, args[0]
        if q.shape[2] == tokens and q.shape[1] != tokens:
            heads_first = True
        elif q.shape[1] == tokens and q.shape[2] != tokens:
            heads_first = False
        else:
            return
        order = (lambda c: c) if heads_first else (lambda c: c.transpose(1, 2))
        parts = [[(t, order(t.comp)) for t in self.tags_of(x) if t.kind == "proj"] for x in args[:3]]
        self.attention_event(*parts, None, args[2])
        if out.ndim == 4:
            b, h, hd = out.shape[0], out.shape[1 if heads_first else 2], out.shape[-1]
            idx = (torch.arange(b * h).reshape(b, h, 1, 1) * hd + torch.arange(hd)).expand(b, h, tokens, hd)
            self.tags[out] = [Tag("attn", -1, order(idx), size=hd)]

    def attention_event(self, q_tags, k_tags, v_tags, out, v) -> None:
        for which, tags in (("q", q_tags), ("k", k_tags), ("v", v_tags)):
            for tag, comp in tags:
                heads = comp.flatten(0, -3)[:, 0, :] if comp.ndim >= 3 else comp[:1]
                self.ev.attention.append(AttentionUse(tag.pid, which, torch.unique(heads, dim=0)))
        if out is None:
            return
        hd = out.shape[-1]
        if out.ndim >= 3:
            lead = out.shape[:-2]
            idx = torch.arange(int(torch.Size(lead).numel())).reshape(*lead, 1, 1) * hd + torch.arange(hd)
            self.tags[out] = [Tag("attn", -1, idx.expand(tuple(out.shape)), size=hd)]


def _looks_like_attention(name: str, args) -> bool:
    """An attention kernel of another library (``flash_attn``'s, a custom operator): q, k, v
    as its first three arguments, 4-D with one head size."""
    if "attn" not in name and "attention" not in name:
        return False
    qkv = args[:3]
    return (
        len(qkv) == 3
        and all(isinstance(t, torch.Tensor) and t.ndim == 4 for t in qkv)
        and qkv[0].shape[-1] == qkv[1].shape[-1]
    )


def _by_feature(comp: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The companion of an operation that moves whole rows (token gathers and scatters,
    padding) of a tensor whose companion depends on the last (feature) axis only; else None."""
    if comp.ndim == 0 or not shape or comp.shape[-1] != shape[-1] or comp.numel() == 0:
        return None
    row = comp.reshape(-1, comp.shape[-1])
    if not bool((row == row[:1]).all()):
        return None
    return row[0].expand(shape)


def _first_row(comp: torch.Tensor) -> torch.Tensor:
    return comp.reshape(-1, comp.shape[-1])[0]


def _with(tag: Tag, comp: torch.Tensor) -> Tag:
    return Tag(tag.kind, tag.pid, comp, tag.act, tag.gated, tag.size, tag.probs, tag.parts)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


#: operations that move elements without combining them: their companion is the operation
#: applied to the companion (with the index arguments' constant values).
_MOVES = {
    "index",
    "index_select",
    "gather",
    "flip",
    "roll",
    "repeat",
    "repeat_interleave",
    "tile",
    "constant_pad_nd",
    "slice_copy",
    "select_copy",
}


def _apply_same(func, comp, args, kwargs):
    """``func`` applied to a companion in place of its first argument; tensors among the other
    arguments must be constants the model made (indices from Python lists), else None."""

    def real(x):
        if isinstance(x, torch.Tensor):
            constant = getattr(x, "constant", None)
            if constant is not None:
                return constant
            raise LookupError
        return x

    try:
        rest = tree_map(real, (list(args[1:]), dict(kwargs)))
        return func(comp, *rest[0], **rest[1])
    except (LookupError, RuntimeError, TypeError, IndexError):
        return None


def _apply_view(func, comp, args, kwargs):
    try:
        res = func(comp, *args[1:], **kwargs)
    except RuntimeError:
        name = _name(func)
        if name in ("view", "_unsafe_view"):
            res = comp.reshape(args[1])
        else:
            return None
    return list(res) if isinstance(res, (list, tuple)) else [res]


def _grouped_mm_fake(a, b, offs=None, bias=None, out_dtype=None):
    """Shape of ``torch._grouped_mm`` without its device checks (a 2-D ``a`` against a
    3-D ``b``: one row group per expert)."""
    if a.ndim == 2 and b.ndim == 3:
        shape = (a.shape[0], b.shape[-1])
    elif a.ndim == 3 and b.ndim == 3:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    elif a.ndim == 2 and b.ndim == 2:
        shape = (offs.shape[0], a.shape[0], b.shape[-1])
    else:
        shape = (a.shape[0], b.shape[-1])
    return torch.empty(shape, dtype=out_dtype or a.dtype, device=a.device)


@contextlib.contextmanager
def _real_tensors():
    """Companions are real (small) CPU tensors: leave the fake mode while they are made."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


#: forwards to run in place of a module's own during the trace, by qualified class name
#: (:func:`register_trace_forward`).
_TRACE_FORWARDS: dict[str, Callable[..., Any]] = {}


def register_trace_forward(qualified_class: str, forward: Callable[..., Any]) -> None:
    """Run ``forward(module, *args, **kwargs)`` in place of the forward of every module of
    class ``qualified_class`` (``"package.module.Class"``, subclasses included) during the
    trace: for a module whose own forward needs a device kernel (a CUDA-only token dispatch)
    the substitute computes the same products with torch operations on every expert."""
    _TRACE_FORWARDS[qualified_class] = forward


def _trace_forward_of(module: nn.Module) -> Callable[..., Any] | None:
    for cls in type(module).__mro__:
        found = _TRACE_FORWARDS.get(f"{cls.__module__}.{cls.__qualname__}")
        if found is not None:
            return found
    return None


@contextlib.contextmanager
def _substituted(model: nn.Module) -> Iterator[None]:
    patched = []
    for m in model.modules():
        fn = _trace_forward_of(m)
        if fn is not None:
            patched.append((m, "forward" in vars(m), vars(m).get("forward")))
            m.forward = types.MethodType(fn, m)
    try:
        yield
    finally:
        for m, had, old in patched:
            if had:
                m.forward = old
            else:
                del m.forward


@contextlib.contextmanager
def _hooks_off(model: nn.Module) -> Iterator[None]:
    """Every module's forward hooks removed for the duration (FSDP2 unshards, TP
    redistributes, DDP syncs there), and restored afterwards."""
    saved = []
    for m in model.modules():
        saved.append((m, m._forward_pre_hooks, m._forward_hooks))
        m._forward_pre_hooks = type(m._forward_pre_hooks)()
        m._forward_hooks = type(m._forward_hooks)()
    try:
        yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post


def _logits_of(out: Any, recorder: _Recorder) -> list[Tag]:
    """The projection tags of the model's output logits: ``.logits`` / ``["logits"]`` when
    the output names them, else the one output tensor that is a projection's output."""
    named = getattr(out, "logits", None)
    if not isinstance(named, torch.Tensor) and isinstance(out, dict):
        named = out.get("logits")
    leaves = (
        [named] if isinstance(named, torch.Tensor) else [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    )
    found = [[t for t in recorder.tags_of(leaf) if t.kind == "proj"] for leaf in leaves]
    found = [f for f in found if f]
    return found[0] if len(found) == 1 else []


def _global_meta(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s global shape and dtype (DTensors give their global shape)."""
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


def trace_model(model: nn.Module, tokens: tuple[int, int] = (1, 8), vocab: int | None = None) -> Evidence:
    """Run ``model`` once on fake tensors and return what each parameter fed.

    Args:
        model: the bare model (not a DDP or compile wrapper).
        tokens: the ``(batch, sequence)`` shape of the token batch.
        vocab: token ids are drawn below this (their values do not matter on fake tensors).

    Raises:
        TraceFailed: when the forward cannot run on fake tensors (the message has the cause).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    params: list[nn.Parameter] = []
    index: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=True):
        index[id(p)] = len(params)
        params.append(p)
    evidence = Evidence(params)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    cpu = torch.device("cpu")

    def fake(t: torch.Tensor) -> torch.Tensor:
        return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, _global_meta(t), cpu)

    values: dict[str, torch.Tensor] = {}
    fakes: dict[int, int] = {}
    made: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in made:
            made[id(p)] = fake(p).requires_grad_(p.requires_grad)
            fakes[id(made[id(p)])] = index[id(p)]
        values[name] = made[id(p)]
    for name, b in model.named_buffers(remove_duplicate=False):
        values[name] = fake(b)
    recorder = _Recorder(evidence, fakes, tokens[-1])
    with fake_mode:
        ids = torch.zeros(tokens, dtype=torch.long)
    recorder.tokens[ids] = True
    try:
        with warnings.catch_warnings(), _hooks_off(model), _substituted(model), fake_mode, recorder:
            warnings.simplefilter("ignore")  # the model's own warnings belong to its real forward
            try:
                out = functional_call(model, values, (ids,), strict=False)
            except TypeError:
                out = functional_call(model, values, (), {"input_ids": ids}, strict=False)
    except Exception as err:
        raise TraceFailed(f"{type(err).__name__}: {err}".splitlines()[0][:300]) from err
    evidence.logits = _logits_of(out, recorder)
    return evidence
