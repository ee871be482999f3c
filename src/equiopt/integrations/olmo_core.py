"""OLMo-core: an ``OptimConfig`` that builds equiopt's optimizer, so an OLMo-core training
script swaps its optimizer config and nothing else.

```python
from equiopt.integrations.olmo_core import EquioptConfig

train_module_config = TransformerTrainModuleConfig(
    optim=EquioptConfig(recipe="paper:olmoe:ii"),  # in place of AdamWConfig(...) / MuonConfig(...)
    scheduler=CosWithWarmup(warmup_steps=...),     # OLMo-core's own schedule, as before
    ...
)
```

Roles come from the model's forward (``equiopt.assign_roles``): OLMo-core's square query
projections, 2-D expert stacks (``w1``/``w3`` stored ``(experts * d_model, hidden)`` for
``MoEMLP`` and ``(experts * hidden, d_model)`` for ``DroplessMoEMLP``) and flat routers
(``(experts * d_model,)``) get the roles and per-head / per-expert work matrices of DESIGN.md's
table. OLMo-core's token dispatch for experts (``gather`` / ``binned_gather`` of
``olmo_core.ops.moe``) runs Triton kernels, CUDA only; for the trace only, the module registers a
forward that applies the same expert weights, through the module's own expert MLP, to every
token on every expert (all of them, the trace holding the global stacks under expert
parallelism too).

The recipe's per-role learning rates become each group's ``initial_lr``, which OLMo-core's
scheduler scales every step (its warm-up and decay shape every role alike; the recipe's own
per-role schedules are not used under OLMo-core's trainer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..optim import EquivariantOptimizer
from ..roles import build_optimizer
from ..roles.dataflow import register_trace_forward

__all__ = ["EquioptConfig", "experts_on_every_token"]


class _HostCounts:
    """Tokens per expert as the host array the dropless MLP's loop over experts reads
    (``batch_sizes.cpu().numpy()``), kept out of the fake mode of the trace."""

    def __init__(self, counts: list[int]):
        self.counts = counts

    def cpu(self) -> _HostCounts:
        return self

    def numpy(self):
        import numpy as np

        return np.asarray(self.counts)


def experts_on_every_token(self, x, expert_weights=None, expert_indices=None, batch_size_per_expert=None, **_):
    """Trace forward of OLMo-core's ``ParallelMLPBase``: every token through every expert
    with the module's own expert MLP (its CUDA-only dispatch left out); same output shape."""
    from olmo_core.nn.moe.mlp import DroplessMoEMLP

    flat = x.reshape(-1, x.shape[-1])
    mlp = self.mlp
    experts = int(mlp.num_experts)  # the trace holds every expert's weights, expert-parallel or not
    if isinstance(mlp, DroplessMoEMLP):  # FSDP2 renames the class (FSDPDroplessMoEMLP) and keeps this base
        out = mlp(flat.repeat(experts, 1), _HostCounts([flat.shape[0]] * experts))
        out = out.reshape(experts, flat.shape[0], -1).sum(0)
    else:
        out = mlp(flat.unsqueeze(0).expand(experts, -1, -1)).sum(0)
    return out.reshape(x.shape)


register_trace_forward("olmo_core.nn.moe.parallel_mlp.ParallelMLPBase", experts_on_every_token)


try:
    from olmo_core.optim.config import INITIAL_LR_FIELD, LR_FIELD, OptimConfig
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("equiopt.integrations.olmo_core needs OLMo-core: pip install 'equiopt[olmo]'") from err


@OptimConfig.register("equiopt")
@dataclass
class EquioptConfig(OptimConfig):
    """OLMo-core ``OptimConfig`` for equiopt: ``recipe`` (a recipe name or TOML path),
    ``overrides`` (per-role recipe fields), ``rules`` (role overrides by regex on
    parameter names, as :func:`equiopt.assign_roles` takes them), ``state_dtype`` (e.g.
    ``"bfloat16"``), ``compile`` (equiopt's compiled step), ``extra`` (further keyword
    arguments of :func:`equiopt.build_optimizer`). ``group_overrides`` is not used: roles
    make the groups."""

    recipe: str = "equiopt:default"
    overrides: dict[str, dict[str, Any]] | None = None
    rules: dict[str, Any] | None = None
    state_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def optimizer(cls):
        return EquivariantOptimizer

    def build(self, model: nn.Module, strict: bool = True) -> EquivariantOptimizer:
        if self.group_overrides:
            raise ValueError(
                "EquioptConfig: group_overrides is not used (roles make the param groups); "
                "set overrides={role: {...}} or rules={regex: role} instead"
            )
        state_dtype = getattr(torch, self.state_dtype) if self.state_dtype else None
        optimizer, _ = build_optimizer(
            model,
            self.recipe,
            overrides=self.overrides,
            rules=self.rules,
            state_dtype=state_dtype,
            eager_state=True,  # every rank's checkpoint has the same keys before the first step
            compile=self.compile or None,
            **self.extra,
        )
        fixed: list[dict[str, Any]] = []
        for group in optimizer.param_groups:
            group.setdefault(INITIAL_LR_FIELD, float(group[LR_FIELD]))
            fixed.append({k: group[k] for k in self.fixed_fields if k in group})

        def reset_fixed_fields(opt: torch.optim.Optimizer) -> None:
            for kept, group in zip(fixed, opt.param_groups):
                group.update(kept)

        optimizer.register_load_state_dict_post_hook(reset_fixed_fields)
        return optimizer
