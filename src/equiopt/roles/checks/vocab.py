"""The ``vocab`` check: one permutation of the vocabulary applied to the rows of the
embedding and LM head (and the input ids relabelled); the output distribution must be
permuted the same way."""

from __future__ import annotations

import torch

from .biases import _BiasMoves
from .moves import _work_rows_plan


class _VocabCheck(_BiasMoves):
    """The ``vocab`` check, embedding and LM head together."""

    def vocab_check(self):
        V = self.base.shape[-1]
        emb, head = [], []
        for r in self.table:
            if r.role not in ("embedding", "lm_head") or r.layout is None:
                continue
            rows = sorted({s[-2] for s in r.work_shapes})
            if rows != [V]:
                self._fail("vocab", [r.name], f"{r.role} work rows {rows} are not the vocabulary ({V} logits)")
            else:
                (emb if r.role == "embedding" else head).append(r)
        if not emb and not head:
            return
        output_side = bool(head) or bool(getattr(self.table, "tied_embeddings", False))
        perm = self._perm(V)
        plan: list = []
        notes: list[str] = []
        for r in emb + head:
            new, src = _work_rows_plan(r.layout, r.param, perm, r.name)
            plan.append((r.param, new))
            if r.role == "lm_head":
                self._plan_bias(r, src, plan, notes)
        ids, sides = self.ids, []
        if emb:
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(V)
            ids = inverse.to(self.ids.device)[self.ids]
            sides.append("input ids relabelled")
        else:
            notes.append("no embedding in the table: only the output side checked")
        if output_side:
            sides.append("output permuted")
        else:
            notes.append("no lm_head in the table: only the input side checked")
        detail = f"permutation of {V} vocabulary rows ({', '.join(sides)})"
        self._run("vocab", plan, "; ".join([detail] + notes), ids=ids, out_perm=perm if output_side else None)
