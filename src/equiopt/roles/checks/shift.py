"""The ``shift`` check: ``1 a^T`` added to every work matrix of an LM head or a router;
softmax and top-k ignore a shared logit shift, so the output must not change."""

from __future__ import annotations

import torch

from .moves import _shift_plan
from .runner import _RunnerBase


class _ShiftChecks(_RunnerBase):
    """The ``shift`` checks, one per LM head and router."""

    def shift_checks(self):
        for r in self.table:
            if r.role not in ("lm_head", "router") or r.layout is None:
                continue
            shifts = [torch.randn(*s[:-2], 1, s[-1], generator=self.gen) for s in r.work_shapes]
            what = "vocabulary" if r.role == "lm_head" else "expert"
            detail = f"{r.role}: 1 a^T added to each work matrix (a shared {what}-logit shift)"
            if r.role == "router" and r.param.dtype in (torch.float16, torch.bfloat16):
                detail += (
                    "; in half precision the rounded shift can flip top-k choices between near-tied "
                    "experts: confirm a failure in float32"
                )
            self._run("shift", [(r.param, _shift_plan(r.layout, r.param, shifts, r.name))], detail)
