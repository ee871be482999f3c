"""The machinery every check shares: the unmodified model's log-probabilities and the
tolerance, moving weights as a plan says, running the model, comparing, restoring the
weights bit for bit and recording a :class:`RoleCheck`; and the random permutations."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .forward import _default_forward, _logits
from .report import RoleCheck


class _RunnerBase:
    """The state of one verification (model, table, input, tolerances, results) and the steps every check uses."""

    def __init__(self, model, table, input_ids, forward_fn, gen, rtol, atol):
        self.model, self.table, self.ids, self.gen = model, table, input_ids, gen
        self.forward_fn = forward_fn or _default_forward(model)
        self.rtol, self.atol = rtol, atol
        self.results: list[RoleCheck] = []
        self.notes: list[str] = []
        self.modules = dict(model.named_modules())
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.names_of: dict[int, str] = {}
        self.roles = {id(row.param): row.role for row in table}
        for row in table:
            self.names_of.setdefault(id(row.param), row.name)
        for name, p in self.params.items():
            self.names_of.setdefault(id(p), name)
        self.conv_checked: set[str] = set()

    # -- model evaluation ---------------------------------------------------------
    def start(self):
        self.base = self._logprobs(self.ids)
        centred = self.base - self.base.mean(-1, keepdim=True)
        self.scale = float(centred.abs().max())
        floor = 8 * torch.finfo(self.base.dtype).eps * float(self.base.abs().max())
        self.tolerance = self.atol + self.rtol * self.scale + floor

    def _logprobs(self, ids: Tensor) -> Tensor:
        logits = _logits(self.forward_fn(self.model, ids))
        work = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return logits.detach().to(work).log_softmax(-1)

    def _run(
        self,
        kind: str,
        plan: list[tuple[nn.Parameter, Callable[[], Tensor]]],
        detail: str,
        ids: Tensor | None = None,
        out_perm: Tensor | None = None,
    ):
        """Move the weights as ``plan`` says, compare outputs, restore bit for bit, record.

        ``plan``: ``(param, new)`` where ``new()`` computes the moved value from the
        current values. All new values are computed before any is written.
        """
        params, seen = [], set()
        for q, _ in plan:
            if id(q) not in seen:
                seen.add(id(q))
                params.append(q)
        saved = [(q, q.detach().clone()) for q in params]
        try:
            news = [(q, new()) for q, new in plan]
            for q, value in news:
                q.copy_(value)
            out = self._logprobs(self.ids if ids is None else ids)
        finally:
            for q, old in reversed(saved):
                q.copy_(old)
        base = self.base
        if out_perm is not None:
            base = base.index_select(-1, out_perm.to(base.device))
        if out.shape != base.shape:
            change = math.inf
        else:
            change = float((out - base).abs().max())
            if math.isnan(change):
                change = math.inf
        names = tuple(self.names_of.get(id(q), "?") for q in params)
        self.results.append(RoleCheck(kind, names, change, self.tolerance, change <= self.tolerance, detail))

    def _fail(self, kind: str, names: Sequence[str], detail: str):
        """Record a failed check that could not be run or could not confirm anything."""
        self.results.append(RoleCheck(kind, tuple(names), math.inf, self.tolerance, False, detail))

    # -- random draws (CPU generator, moved to the parameter's device) -------------
    def _perm(self, n: int) -> Tensor:
        perm = torch.randperm(n, generator=self.gen)
        if n > 1 and bool((perm == torch.arange(n)).all()):
            perm = perm.roll(1)
        return perm

    def _perms(self, batch: int, n: int) -> Tensor:
        return torch.stack([self._perm(n) for _ in range(batch)])

    def _role_of(self, q: Tensor) -> str:
        role = self.roles.get(id(q))
        return f"role {role}" if role is not None else "not in the role table"
