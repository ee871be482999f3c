"""Attention projections: per-head layouts for q/k/v (separate or fused) and output
projections, found from the head size in force and the storage convention, and the
projections of multi-head latent attention (DeepSeek V2/V3)."""

from __future__ import annotations

import re
from typing import NamedTuple

from torch import nn

from ...layouts import Heads, Row
from .context import _ContextBase, _Decision
from .dims import _positive_int
from .errors import _nd_fix
from .names import _ATTN_IN_NAMES, _ATTN_OUT_NAMES, _short


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


class _AttentionRoles(_ContextBase):
    """The role and layout of a weight inside an attention block."""

    def _attention(self, name, module, attr, p, block):
        d = self.dims
        if p.ndim != 2:
            raise self._fail(
                name,
                p.shape,
                "a non-matrix tensor in an attention block",
                fix=_nd_fix(name, tuple(p.shape)) if p.ndim > 2 else None,
            )
        st, out, inp = self._oriented(module, attr, p)
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
        both = [
            (f"('attention', 'heads:{hd}')", "for a query, key or value projection stored (out, in)"),
            (f"('attention', 'heads_cols:{hd}')", "for the output projection stored (out, in)"),
        ]
        if st == "unknown" and input_side and output_side:
            raise self._fail(name, p.shape, f"square weight in {where} with unknown storage convention", both)
        if input_side and output_side:
            if short in _ATTN_OUT_NAMES:
                input_side = False
            elif short in _ATTN_IN_NAMES:
                output_side = False
            else:
                raise self._fail(name, p.shape, "square attention projection: cannot tell q/k/v from output", both)
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
