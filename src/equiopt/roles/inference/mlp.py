"""MLP projections: which side of the block a weight is on (input: rows = neurons;
output: neurons x hidden), fused gate/up inputs, scalar gates, and the hand-off to the
router and expert rules of an MoE block."""

from __future__ import annotations

from torch import nn

from ...layouts import Col, GateUp, Row
from .context import _Decision
from .experts import _ExpertRoles
from .gate_up import _GateUpProbe
from .names import _MLP_IN_NAMES, _MLP_OUT_NAMES, _short

#: ``rules=`` values for an MLP matrix whose side is unknown, and when each is right.
_IN_OUT = [
    ("('mlp_in', 'row')", "for an input projection stored (out, in)"),
    ("('mlp_out', 'col')", "for the output projection stored (out, in)"),
]


class _MlpRoles(_ExpertRoles, _GateUpProbe):
    """The role and layout of a weight inside an MLP (or MoE) block."""

    def _mlp(self, name, mod_name, module, attr, p, ctx, want):
        d = self.dims
        block = ctx.module if ctx is not None else module
        where = type(block).__name__
        shape = tuple(p.shape)
        if p.ndim == 2 and want in (None, "router"):
            router = self._router(module, shape, where, want)
            if router is not None:
                return router
        if p.ndim == 3:
            return self._experts(name, module, attr, p, where)
        if p.ndim != 2:
            return None
        st, out, inp = self._oriented(module, attr, p)
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
            raise self._fail(
                name, shape, f"square weight in {where}: cannot tell input from output projection", _IN_OUT
            )
        if st == "unknown" and inp == out:
            raise self._fail(name, shape, f"weight in {where} with unknown storage convention", _IN_OUT)
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
        for _, oriented in self._matrices_in(block, p):
            if oriented.out_features == self.dims.hidden and oriented.in_features != self.dims.hidden:
                return oriented.in_features
        return None
