"""One ``torch.optim.Optimizer`` for every symmetry-compatible rule (Algorithms 1 and 2).

Per parameter and step, with gradient ``G``:

    M <- beta M + (1 - beta) G                      (EMA momentum; Nesterov: D = beta M + (1 - beta) G, else D = M)
    U <- layout.from_work(map(layout.to_work(D)))   (the group's rule on the work matrices)
    W <- (1 - lr wd) W - lr s U                     (decoupled weight decay; s = lr_scale factor)

Work matrices from all parameters (of all groups) whose map settings and shapes agree
are concatenated and mapped in one batched call, then split back exactly.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
from torch.optim import Optimizer

from ..layouts import Layout, parse_layout
from .rules import ELEMENTWISE_RULES, MATRIX_RULES, apply_map, lr_scale_factor, map_key, resolved, validate_group


class NonFiniteGradientError(FloatingPointError, ValueError):
    """Raised for a NaN/Inf gradient when a group's ``nonfinite="raise"``."""


class EquivariantOptimizer(Optimizer):
    r"""Symmetry-compatible optimizer; each param group names its rule, layout and settings.

    Group keys (all optional, defaults below):

    - ``rule``: ``"spectral"`` (Muon: polar factor), ``"right"`` (RightPolarGradM),
      ``"left"`` (LeftPolarGradM), ``"row"`` (RowNormM), ``"hybrid"`` (HybridPolarGradM,
      with ``order``), ``"adamw"``, ``"sgd"``.
    - ``layout``: a :mod:`equiopt.layouts` layout or spec string (default ``"row"``), or
      ``layouts``: one per parameter (``None`` entries use ``layout``).
    - ``center`` (horizontal/quotient maps for LM heads and routers), ``order``,
      ``alpha`` (``nu^alpha``; default 1 for hybrid, 0 otherwise), ``eps``, ``method``,
      ``steps``, ``eta`` (row-scaling rule), ``polar_dtype`` (spectral iteration
      precision; default bfloat16).
    - ``lr``, ``beta`` (EMA momentum), ``nesterov`` (default True for spectral, False
      otherwise), ``weight_decay`` (decoupled), ``betas`` and ``adam_eps`` (adamw).
    - ``lr_scale``: shape factor of the spectral rule, ``"spectral"`` (default for it:
      ``sqrt(max(1, rows/cols))`` of each work matrix, Muon's convention), ``"match_adamw"``
      (``0.2 sqrt(max(rows, cols))``) or ``"none"``.
    - ``nonfinite``: ``"skip"`` (default: a parameter whose gradient has NaN/Inf is left
      untouched, weights and state, and counted in :attr:`nonfinite_steps`) or
      ``"raise"`` (:class:`NonFiniteGradientError` before anything is modified).
    - ``names``: parameter names for messages (one per parameter).

    ``state_dtype`` holds momentum and Adam moments (default: float32 for bfloat16,
    float16 and float32 parameters, float64 for float64 ones); ``eager_state=True`` creates all state at construction so every rank
    and checkpoint sees the same keys from step 0.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        rule: str = "spectral",
        layout: Any = "row",
        center: bool = False,
        order: str = "row_then_right",
        beta: float = 0.95,
        nesterov: bool | None = None,
        alpha: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        method: str = "polar_express",
        steps: int = 5,
        eta: str | Callable = "inverse",
        betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        lr_scale: str | None = None,
        polar_dtype: torch.dtype | None = None,
        nonfinite: str = "skip",
        scale: str | None = None,
        state_dtype: torch.dtype | None = None,
        eager_state: bool = False,
    ):
        self.state_dtype = state_dtype
        self.eager_state = eager_state
        self.nonfinite_steps = 0
        self.last_nonfinite: list[str] = []
        defaults = dict(
            lr=lr, rule=rule, layout=layout, layouts=None, names=None, center=center, order=order, beta=beta,
            nesterov=nesterov, alpha=alpha, eps=eps, weight_decay=weight_decay, method=method, steps=steps,
            eta=eta, betas=tuple(betas), adam_eps=adam_eps, lr_scale=lr_scale, polar_dtype=polar_dtype,
            nonfinite=nonfinite, scale=scale,
        )
        super().__init__(params, defaults)

    # ----------------------------------------------------------------- groups
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        self._prepare_group(group, index)
        if self.eager_state:
            for p in group["params"]:
                self._init_state(p, group)

    def _prepare_group(self, group: dict, index: int) -> None:
        where = f"param_groups[{index}]"
        validate_group(group, where)
        params = group["params"]
        names = group.get("names")
        if names is None:
            names = [f"{where}.params[{j}]" for j in range(len(params))]
        elif len(names) != len(params):
            raise ValueError(f"{where}: 'names' has {len(names)} entries for {len(params)} parameters")
        group["names"] = list(names)
        per_param = group.get("layouts")
        if per_param is not None and len(per_param) != len(params):
            raise ValueError(f"{where}: 'layouts' has {len(per_param)} entries for {len(params)} parameters")
        layouts = []
        for j, p in enumerate(params):
            spec = group["layout"] if per_param is None or per_param[j] is None else per_param[j]
            try:
                layout = parse_layout(spec)
            except ValueError as err:
                raise ValueError(f"parameter {names[j]!r}: {err}") from None
            if group["rule"] in MATRIX_RULES:
                if p.ndim < 2:
                    raise ValueError(
                        f"parameter {names[j]!r} has shape {tuple(p.shape)}: rule {group['rule']!r} needs a matrix "
                        f"(2-D or more); give vectors and scalars rule 'adamw' or 'sgd'"
                    )
                layout.check(tuple(p.shape), names[j])
            layouts.append(layout)
        group["layouts"] = layouts

    # ------------------------------------------------------------------ state
    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if state:
            return state
        dtype = self._state_dtype(p)
        zeros = lambda: torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)  # noqa: E731
        if group["rule"] == "adamw":
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = zeros()
            state["exp_avg_sq"] = zeros()
        else:
            state["momentum_buffer"] = zeros()
        return state

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        if self.state_dtype is not None:
            return self.state_dtype
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    def state_dict(self) -> dict:
        """torch's state dict, with layouts as spec strings so ``torch.load(weights_only=True)`` reads it."""
        sd = super().state_dict()
        for group in sd["param_groups"]:
            group["layouts"] = [layout.spec for layout in group["layouts"]]
        sd["nonfinite_steps"] = self.nonfinite_steps
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        sd = dict(state_dict)
        self.nonfinite_steps = int(sd.pop("nonfinite_steps", 0))
        saved = sd["state"]
        super().load_state_dict(sd)
        for group in self.param_groups:
            group["layouts"] = [parse_layout(spec) for spec in group["layouts"]]
        # torch casts floating state to each parameter's dtype; keep the saved dtypes
        # (float32 moments of bfloat16 parameters) so a round trip is exact.
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for key, value in saved.get(i, {}).items():
                if torch.is_tensor(value) and value.is_floating_point() and key != "step":
                    self.state[p][key] = value.to(device=p.device, dtype=value.dtype, copy=True)

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_nonfinite = []
        buckets: dict[tuple, list] = defaultdict(list)
        jobs = []
        for group in self.param_groups:
            live = self._finite_params(group)
            if not live:
                continue
            if group["rule"] == "adamw":
                self._adamw(group, live)
                continue
            for p, layout in live:
                direction = self._momentum_direction(p, group)
                if group["rule"] == "sgd":
                    self._apply(p, group, direction, 1.0)
                    continue
                work = layout.to_work_list(direction)
                job = (p, group, layout, [None] * len(work))
                jobs.append(job)
                key = map_key(group)
                for k, w in enumerate(work):
                    buckets[(key, tuple(w.shape[-2:]))].append((w, job, k))
        for (key, shape), items in buckets.items():
            self._run_bucket(key, shape, items)
        for p, group, layout, out in jobs:
            self._apply(p, group, layout.from_work_list(out), 1.0)
        return loss

    def _finite_params(self, group: dict) -> list[tuple[torch.Tensor, Layout]]:
        live = [(p, layout, name) for p, layout, name in zip(group["params"], group["layouts"], group["names"]) if p.grad is not None]
        if not live:
            return []
        for p, _, name in live:
            if p.grad.is_sparse:
                raise ValueError(f"parameter {name!r}: sparse gradients are not supported")
        # One reduction per gradient and one host sync per group: a NaN or Inf anywhere
        # makes the sum non-finite (a finite gradient overflows it only beyond ~1e38).
        flags = torch.stack([p.grad.sum().isfinite() for p, _, _ in live]).tolist()
        bad = [name for (_, _, name), ok in zip(live, flags) if not ok]
        if bad:
            if group["nonfinite"] == "raise":
                raise NonFiniteGradientError(f"non-finite gradient in {', '.join(repr(b) for b in bad)}")
            self.nonfinite_steps += len(bad)
            self.last_nonfinite.extend(bad)
        return [(p, layout) for (p, layout, _), ok in zip(live, flags) if ok]

    def _momentum_direction(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        state = self._init_state(p, group)
        buf = state["momentum_buffer"]
        grad = p.grad.to(buf.dtype)
        beta = group["beta"]
        buf.lerp_(grad, 1.0 - beta)
        if resolved(group, "nesterov"):
            return grad.lerp(buf, beta)
        return buf

    def _run_bucket(self, key: tuple, shape: tuple[int, int], items: list) -> None:
        group = items[0][1][1]
        flat = [w.reshape(-1, *shape) for w, _, _ in items]
        batch = flat[0] if len(flat) == 1 else torch.cat(flat)
        result = apply_map(key, group["eta"], batch)
        sizes = [f.shape[0] for f in flat]
        for (w, (p, grp, layout, out), k), piece in zip(items, torch.split(result, sizes)):
            factor = lr_scale_factor(resolved(grp, "lr_scale"), *shape) if grp["rule"] == "spectral" else 1.0
            piece = piece.reshape(w.shape)
            out[k] = piece if factor == 1.0 else piece * factor

    @staticmethod
    def _apply(p: torch.Tensor, group: dict, update: torch.Tensor, scale: float) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        if wd:
            p.mul_(1.0 - lr * wd)
        p.add_(update.to(p.dtype), alpha=-lr * scale)

    def _adamw(self, group: dict, live: list) -> None:
        """AdamW with bias correction and decoupled decay, with torch's foreach kernels."""
        b1, b2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["adam_eps"]
        buckets: dict[tuple, list] = defaultdict(list)
        for p, _ in live:
            state = self._init_state(p, group)
            state["step"] += 1
            buckets[(p.dtype, p.device, state["exp_avg"].dtype)].append((p, state))
        for (p_dtype, _, s_dtype), items in buckets.items():
            params = [p for p, _ in items]
            grads = [p.grad if p.grad.dtype == s_dtype else p.grad.to(s_dtype) for p in params]
            m = [st["exp_avg"] for _, st in items]
            v = [st["exp_avg_sq"] for _, st in items]
            steps = [float(st["step"]) for _, st in items]
            torch._foreach_lerp_(m, grads, 1.0 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, grads, grads, value=1.0 - b2)
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, [math.sqrt(1.0 - b2**k) for k in steps])
            torch._foreach_add_(denom, eps)
            step_sizes = [-lr / (1.0 - b1**k) for k in steps]
            if wd:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            if p_dtype == s_dtype:
                torch._foreach_addcdiv_(params, m, denom, step_sizes)
            else:
                updates = torch._foreach_div(m, denom)
                torch._foreach_mul_(updates, step_sizes)
                for p, u in zip(params, updates):
                    p.add_(u.to(p_dtype))


__all__ = ["EquivariantOptimizer", "NonFiniteGradientError", "ELEMENTWISE_RULES", "MATRIX_RULES"]
