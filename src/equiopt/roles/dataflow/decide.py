"""From what the forward showed (:class:`~equiopt.roles.dataflow.trace.Evidence`) to a role and
a layout per parameter.

A parameter's role is what it did (DESIGN.md, "Roles from the dataflow"; the paper's Table 1
gives each role its symmetry): the token lookup is the ``embedding``; the projection whose
output is the model's output is the ``lm_head`` (whatever its row count); a projection whose
outputs go through top-k is a ``router``; projections whose outputs become attention's q, k
or v are ``attention`` with one work block per head (the head split the model's own reshape
made), and the projection that consumes attention's output is ``attention`` by columns per
head; the two inputs of ``act(a) * b`` (or the input of a plain ``act(a)`` that a projection
consumes) are ``mlp_in`` and the projection after them ``mlp_out``. The work rows are the
parameter axis that the role's symmetry permutes: the output features for the first kinds,
the contracted axis for the output projections. Expert weights (3-D, or 2-D stacks of
blocks) give one work matrix per expert.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ...layouts import Col, Compose, Experts, GateUp, Heads, Layout, Row, Unflatten
from .trace import Evidence, Product

__all__ = ["Finding", "decide"]

_PRECEDENCE = ("embedding", "lm_head", "router", "attention", "mlp_in", "mlp_out", "matrix")


@dataclass
class Finding:
    """The dataflow's decision for one parameter: ``role``, ``layout`` and the evidence in
    words; ``problem`` when the dataflow saw the role but cannot give a layout (the
    parameter then goes to an error naming it)."""

    role: str
    layout: Layout | None
    reason: str
    problem: str | None = None
    roles_seen: list[str] = field(default_factory=list)


@dataclass
class _Facts:
    products: list[Product] = field(default_factory=list)
    roles: set[str] = field(default_factory=set)
    heads: list[torch.Tensor] = field(default_factory=list)  # q/k/v head rows (output features)
    which: set[str] = field(default_factory=set)
    out_heads: list[torch.Tensor] = field(default_factory=list)  # (2, n): head index, contraction coordinate
    gate_pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    feeds: set[int] = field(default_factory=set)
    positional: bool = False


def _facts(ev: Evidence) -> dict[int, _Facts]:
    facts: dict[int, _Facts] = defaultdict(_Facts)
    for pid in ev.lookups:
        facts[pid].roles.add("embedding")
    for pid in ev.positions - ev.lookups:
        facts[pid].roles.add("matrix")
        facts[pid].positional = True
    for tag in ev.logits:
        facts[tag.pid].roles.add("lm_head")
    for pid in ev.topk:
        facts[pid].roles.add("router")
    for use in ev.attention:
        facts[use.pid].roles.add("attention")
        facts[use.pid].heads.extend(list(use.heads))
        facts[use.pid].which.add(use.which)
    for g in ev.gated:
        facts[g.gate_pid].roles.add("mlp_in")
        facts[g.up_pid].roles.add("mlp_in")
        if g.gate_pid == g.up_pid:
            facts[g.gate_pid].gate_pairs.append((g.gate, g.up))
    for prod in ev.products:
        f = facts[prod.pid]
        f.products.append(prod)
        for tag, coords in prod.inputs:
            if tag.kind == "attn":
                f.roles.add("attention")
                f.out_heads.append(torch.stack([coords[0] // tag.size, coords[1]]))
            elif tag.kind == "proj" and (tag.gated or tag.act):
                f.roles.add("mlp_out")
                if not tag.gated:
                    facts[tag.pid].roles.add("mlp_in")
            elif tag.kind == "proj":
                facts[tag.pid].feeds.add(prod.pid)
    for f in facts.values():
        if f.products and not f.roles:
            f.roles.add("matrix")
    return facts


def _blocks(products: list[Product], p: torch.Tensor) -> tuple[int, int] | None:
    """``(axis, size)`` when the 2-D products each used one block of ``size`` along a
    parameter axis, the blocks tiling it (experts stored as a 2-D stack and applied one at a
    time); None when every product used the whole parameter."""
    for axis in range(p.ndim):
        spans = sorted({q.spans[axis] for q in products if axis in q.spans})
        if not spans or spans == [(0, p.shape[axis])]:
            continue
        sizes = {b - a for a, b in spans}
        if len(sizes) == 1 and [a for a, _ in spans] == list(range(0, p.shape[axis], sizes.pop())):
            return axis, spans[0][1] - spans[0][0]
        return axis, -1
    return None


def _stack_layout(block_axis: int, size: int, rows_axis: int) -> Layout:
    """One work matrix per block of ``size`` along ``block_axis``, rows along ``rows_axis``."""
    if block_axis == 0:
        return Heads(size) if rows_axis == 0 else Compose(Heads(size), Col())
    return Compose(Col(), Heads(size)) if rows_axis == 1 else Compose(Heads(size, "cols"), Col())


def _rows_layout(
    p: torch.Tensor, prod: Product, axis: tuple[int, int] | None, products=()
) -> tuple[Layout | None, str]:
    """The layout whose work rows walk parameter ``axis`` (one work matrix per expert when
    the product was batched over experts), and the words for it."""
    if axis is None:
        return None, "the product's axes could not be read"
    ax, block = axis
    stacked = _blocks(list(products), p) if p.ndim == 2 and prod.batch_axis is None else None
    if stacked is not None:
        b_axis, size = stacked
        if size < 0:
            return None, f"its products used blocks along axis {b_axis} that do not tile it evenly"
        n = p.shape[b_axis] // size
        return _stack_layout(b_axis, size, ax), f"{n} experts stacked as blocks of {size} along axis {b_axis}"
    if p.ndim == 1 and len(prod.view_shape) == 2 and block > 1:
        rows = p.shape[0] // block
        return Unflatten(rows), f"stored flat, applied as a {rows}x{block} matrix"
    if p.ndim == 2 and prod.batch_axis is None and len(prod.view_shape) == 2 and block == 1:
        return (Row(), "rows = stored rows") if ax == 0 else (Col(), "rows = stored columns")
    if p.ndim == 3 and ax in (1, 2) and block == 1:
        inner = Row() if ax == 1 else Col()
        return Experts(inner), f"{p.shape[0]} experts on the leading axis"
    if p.ndim == 2 and prod.batch_axis is not None and prod.batch_axis[0] == 0 and prod.batch_axis[1] > 1:
        size = prod.batch_axis[1]
        experts = p.shape[0] // size
        if ax == 0 and block == 1:
            return Heads(size), f"{experts} experts stacked as blocks of {size} rows"
        if ax == 1:
            return Compose(Heads(size), Col()), f"{experts} experts stacked as blocks of {size} rows, transposed"
    return None, f"a {tuple(p.shape)} parameter used through a view {prod.view_shape} the layouts do not cover"


def _head_blocks(heads: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Distinct ``(start, size)`` row ranges, one per head; raises ValueError if a head's rows
    are not one contiguous range."""
    blocks = set()
    for row in heads:
        vals = row[row >= 0]
        if vals.numel() == 0:
            continue
        lo, hi = int(vals.min()), int(vals.max())
        if hi - lo + 1 != int(torch.unique(vals).numel()):
            raise ValueError("a head's rows are not contiguous")
        blocks.add((lo, hi - lo + 1))
    return sorted(blocks)


def _uniform_heads(blocks: list[tuple[int, int]], rows: int) -> int | None:
    """The head size if ``blocks`` tile ``0..rows`` without overlap, grouping a repeating
    pattern of sizes (a key and a value block per head) into one block; else None."""
    pos = 0
    for start, size in blocks:
        if start != pos:
            return None
        pos += size
    if pos != rows:
        return None
    sizes = [s for _, s in blocks]
    for period in range(1, len(sizes) + 1):
        if len(sizes) % period == 0 and sizes == sizes[:period] * (len(sizes) // period):
            return sum(sizes[:period])
    return None


def _heads_on(base: Layout, size: int) -> Layout | None:
    if base == Row():
        return Heads(size)
    if base == Col():
        return Heads(size, "cols")
    return None


def _gate_mode(pairs: list[tuple[torch.Tensor, torch.Tensor]], rows: int) -> str | None:
    gate, up = pairs[0]
    g, u = gate[gate >= 0], up[up >= 0]
    if g.numel() == 0 or g.numel() != u.numel() or 2 * g.numel() != rows:
        return None
    half = rows // 2
    if torch.equal(torch.sort(g).values, torch.arange(half)) and torch.equal(u, g + half):
        return "concat"
    if torch.equal(torch.sort(g).values, torch.arange(0, rows, 2)) and torch.equal(u, g + 1):
        return "interleave"
    return None


def _gate_up(base: Layout, mode: str, split: bool) -> Layout | None:
    if base == Row():
        return GateUp(mode, split=split)
    if base == Col():
        return GateUp(mode, split=split, axis=1)
    if isinstance(base, Experts) and base.inner in (Row(), Col()):
        return Experts(GateUp(mode, split=split, axis=0 if base.inner == Row() else 1))
    return None


def decide(ev: Evidence, split: bool = True, per_head: bool = True) -> dict[int, Finding]:
    """A :class:`Finding` for every parameter the forward used as a weight (by its index in
    ``ev.params``); parameters it did not use that way are absent."""
    out: dict[int, Finding] = {}
    for pid, f in _facts(ev).items():
        p = ev.params[pid]
        roles = [r for r in _PRECEDENCE if r in f.roles]
        if not roles:
            continue
        role = roles[0]
        if role == "embedding":
            tied = " (also the output projection: tied)" if "lm_head" in f.roles else ""
            out[pid] = Finding(role, Row(), f"token lookup{tied}: rows = vocabulary", roles_seen=roles)
            continue
        prod = f.products[0] if f.products else None
        if role == "matrix" and f.positional and prod is None:
            out[pid] = Finding(role, Row(), "looked up by positions, not tokens: whole matrix", roles_seen=roles)
            continue
        if prod is None:
            out[pid] = Finding(
                role, None, f"{role} by the dataflow", problem="never used in a product", roles_seen=roles
            )
            continue
        contracting = role == "mlp_out" or (role == "attention" and f.out_heads and not f.heads)
        axis = prod.in_axis if contracting else prod.out_axis
        base, words = _rows_layout(p, prod, axis, f.products)
        finding = Finding(role, base, "", roles_seen=roles)
        if base is None:
            finding.problem = words
        if role == "lm_head":
            finding.reason = f"makes the model's output logits ({p.shape[axis[0]] if axis else '?'} rows): {words}"
        elif role == "router":
            finding.reason = f"its outputs go through top-k over experts: {words}"
        elif role == "attention" and base is not None:
            _attention(finding, f, p, base, axis, per_head, contracting)
        elif role == "mlp_in" and base is not None:
            finding.reason = f"input of a gated activation: {words}" if not f.feeds else f"mlp input: {words}"
            if f.gate_pairs:
                rows = p.shape[axis[0]] if axis else 0
                mode = _gate_mode(f.gate_pairs, rows)
                layout = _gate_up(base, mode, split) if mode else None
                if layout is None:
                    finding.problem = "both inputs of act(a) * b come from it, in a pairing the layouts do not cover"
                else:
                    finding.layout = layout
                    finding.reason = f"both inputs of act(gate) * up ({mode}): {words}"
            elif "mlp_in" in f.roles and not any(g for g in ev.gated if pid in (g.gate_pid, g.up_pid)):
                finding.reason = f"input of an activation that a projection consumes: {words}"
        elif role == "mlp_out" and base is not None:
            finding.reason = f"consumes the activated MLP hidden layer: {words}"
        elif role == "matrix":
            finding.reason = f"a projection with no attention, MLP, router or vocabulary role: {words}"
        out[pid] = finding
    return out


def _attention(finding: Finding, f: _Facts, p, base: Layout, axis, per_head: bool, contracting: bool) -> None:
    which = "/".join(sorted(f.which, key="qkv".index)) if f.which else "output"
    if not per_head:
        finding.reason = f"attention {which} projection: whole matrix (per_head=False)"
        return
    rows = p.shape[axis[0]] if axis else 0
    if contracting:
        pairs = torch.cat(f.out_heads, dim=1)
        heads = [pairs[1][pairs[0] == h] for h in torch.unique(pairs[0])]
    else:
        heads = f.heads
    try:
        blocks = _head_blocks(heads)
    except ValueError as err:
        finding.problem = f"attention {which}: {err}"
        return
    size = _uniform_heads(blocks, rows) if not isinstance(base, Experts) else None
    layout = _heads_on(base, size) if size else None
    if layout is None:
        finding.reason = (
            f"attention {which} projection whose rows are not one block per head "
            f"({len(blocks)} head blocks over {rows} rows: shared or latent): whole matrix"
        )
        return
    finding.layout = layout
    side = "columns" if contracting else "rows"
    what = "consumes attention's output" if contracting else f"its outputs become attention's {which}"
    finding.reason = f"{what}: {rows // size} blocks of {size} {side}, one per head"
