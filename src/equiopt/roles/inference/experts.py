"""Mixture-of-experts weights: the router (rows = experts), and expert tensors stacked
along a leading expert axis (their storage, side, and fused gate/up pairing, from the
module's declarations, the tensor's axis names or the hidden size)."""

from __future__ import annotations

from torch import nn

from ...layouts import Col, Experts, GateUp, Row
from .context import _ContextBase, _Decision
from .names import _ROUTER_CLASS, _axes

#: ``rules=`` values for a stack of expert matrices, and when each is right.
_STACK_RULES = [
    ("('mlp_in', 'experts:row')", "for input projections stored (experts, out, in)"),
    ("('mlp_in', 'experts:col')", "for input projections stored (experts, in, out)"),
    ("('mlp_out', 'experts:col')", "for output projections stored (experts, out, in)"),
    ("('mlp_out', 'experts:row')", "for output projections stored (experts, in, out)"),
]


class _ExpertRoles(_ContextBase):
    """The role and layout of a router or an expert tensor inside an MLP (MoE) block."""

    def _router(self, module, shape, where, want) -> _Decision | None:
        """A router: ``(experts, hidden)`` in an MoE block, or a module whose class says so."""
        d = self.dims
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
                raise self._fail(
                    name, p.shape, f"expert tensor in {type(module).__name__} with undeclared storage", _STACK_RULES
                )
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
                raise self._fail(
                    name, p.shape, "square expert tensor: cannot tell input from output projection", _STACK_RULES
                )
        else:
            side = "out" if out == d.hidden else ("in" if inp == d.hidden else None)
        if side is None:
            raise self._fail(name, p.shape, "expert tensor that neither reads nor writes the hidden size", _STACK_RULES)
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
                    [
                        ("('mlp_in', 'experts:gate_up:concat')", "for [gate; up] halves"),
                        ("('mlp_in', 'experts:gate_up:interleave')", "for gate and up rows interleaved"),
                    ],
                )
            mode = "concat" if concatenated else "interleave"
            layout = Experts(GateUp(mode, split=self.split, axis=1 if transposed else 0))
            return _Decision(
                "mlp_in", layout, f"{E} experts' fused gate/up ({mode}{', stored (in, out)' if transposed else ''})"
            )
        inner = Col() if transposed else Row()
        return _Decision("mlp_in", Experts(inner), f"{E} experts' input projections ({inp} -> {out})")
