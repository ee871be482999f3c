"""The bias of a weight (``bias``, ``<W>_bias`` or ``<stem>bias`` of its module), the
axis of the weight it indexes, and how it moves when the weight moves (read off the
layout through the map of stored positions)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..table import RoleRow
from .paths import _join, _module_name
from .runner import _RunnerBase


class _BiasMoves(_RunnerBase):
    """Moves the bias of a weight with the weight."""

    def _plan_bias(self, row: RoleRow, src: Tensor, plan: list, notes: list[str]) -> set[int]:
        """Add the bias of ``row`` (moved like its weight, per ``src``) to ``plan``."""
        found = self._bias_of(row.name, row.param)
        if found is None:
            return set()
        bname, b = found
        index, why = _bias_index(tuple(b.shape), tuple(row.param.shape), src, self._bias_axis(row.name, row.param, b))
        if why:
            notes.append(f"bias {bname} not permuted: {why}")
        elif index is not None:
            index = index.to(b.device)
            plan.append((b, lambda: torch.gather(b, -1, index)))
        return {id(b)}

    def _bias_of(self, name: str, p: Tensor) -> tuple[str, nn.Parameter] | None:
        """The bias of weight ``name``: ``bias``, ``<attr>_bias`` or ``<stem>bias`` of its module."""
        mod_name = _module_name(name)
        attr = name.rsplit(".", 1)[-1]
        mod = self.modules.get(mod_name)
        if mod is None:
            return None
        candidates = ["bias"] if attr == "weight" else []
        candidates.append(attr + "_bias")
        if attr.endswith("weight") and attr != "weight":
            candidates.append(attr[: -len("weight")] + "bias")
        for c in candidates:
            q = mod._parameters.get(c)
            if q is not None and q is not p:
                return _join(mod_name, c), q
        return None

    def _bias_axis(self, name: str, p: Tensor, b: Tensor) -> int | None:
        """The stored axis of ``p`` (-2 or -1) that its bias ``b`` indexes, or None."""
        lead = tuple(p.shape[:-2])
        rows_fit = tuple(b.shape) == lead + (p.shape[-2],)
        cols_fit = tuple(b.shape) == lead + (p.shape[-1],)
        if rows_fit != cols_fit:
            return -2 if rows_fit else -1
        if not rows_fit:
            return None
        mod = self.modules.get(_module_name(name))  # square weight: the storage convention decides
        if isinstance(mod, nn.Linear):
            return -2
        if type(mod).__name__ == "Conv1D":
            return -1
        transposed = getattr(mod, "is_transposed", None)
        if isinstance(transposed, bool):
            return -1 if transposed else -2
        return None


def _bias_index(
    b_shape: tuple[int, ...], p_shape: tuple[int, ...], src: Tensor, axis: int | None
) -> tuple[Tensor | None, str]:
    """How a bias of ``p`` moves when ``p`` moves by the source map ``src``.

    Returns ``(index, "")``: gather the bias along its last axis with ``index``;
    ``(None, "")``: the move leaves the axis the bias indexes alone (e.g. the hidden
    axis of an output projection); ``(None, why)``: it cannot be followed.
    """
    if axis is None:
        return None, f"shape {b_shape} does not index one output axis of the weight {p_shape}"
    coords = torch.unravel_index(src.reshape(-1), p_shape)
    grid = torch.unravel_index(torch.arange(src.numel()), p_shape)
    if not all(bool((c == g).all()) for c, g in zip(coords[:-2], grid[:-2])):
        return None, "the move mixes the leading axes of the weight"
    other = -1 if axis == -2 else -2
    axis_fixed = bool((coords[axis] == grid[axis]).all())
    other_fixed = bool((coords[other] == grid[other]).all())
    if axis_fixed:
        return None, ""
    if not other_fixed:
        return None, "the layout moves both axes of the weight, so the bias's positions cannot be followed"
    source = coords[axis].view(p_shape)
    index = source.select(other, 0)
    if not bool((source == index.unsqueeze(other)).all()):
        return None, "the move along the bias's axis differs between columns of the weight"
    return index, ""
