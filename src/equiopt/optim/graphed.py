"""A CUDA-graph replay of :class:`~.engine.EquivariantOptimizer`'s step.

After its first call the step allocates no new state (the buckets' stacks and gradient
buffer are made once, :mod:`.buckets`) and reads nothing back to the host, so the whole
step can be captured in one CUDA graph and replayed: one launch instead of a few hundred.
:class:`GraphedStep` takes ``warmup`` eager steps, captures the next one, and replays it
from then on. What a replay needs to stay the same:

- the gradients are the same tensors at every step: clear them with
  ``model.zero_grad(set_to_none=False)`` (or ``optimizer.zero_grad(set_to_none=False)``)
  so backward accumulates into the buffers the graph reads;
- the learning rates are device tensors the graph reads: a float ``lr`` set by a scheduler
  is copied into them before each replay; a tensor ``lr`` must be updated in place;
- the parameters, their groups and their state are the ones captured (a new group or a
  loaded state dict needs a new :class:`GraphedStep`).

Each of these is checked before a replay, and a change raises a ``RuntimeError`` that
says what to do, rather than replaying a graph over stale addresses. Step hooks registered
on the optimizer (``register_step_pre_hook``) are not run by a graphed step.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GraphedStep"]


class GraphedStep:
    """``step()`` of an :class:`~equiopt.optim.EquivariantOptimizer` replayed from a CUDA graph.

    Args:
        optimizer: the optimizer; every parameter a plain CUDA tensor, nothing divided
            among replicas (a graph cannot hold collectives across processes here).
        warmup: eager steps before the capture (at least 1: the first step makes the state).

    Example::

        step = equiopt.optim.GraphedStep(optimizer)
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            step()
            scheduler.step()
            model.zero_grad(set_to_none=False)
    """

    def __init__(self, optimizer: Any, warmup: int = 3):
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (the first step makes the state), got {warmup}")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        off = [p for p in params if p.device.type != "cuda"]
        if off or not torch.cuda.is_available():
            raise ValueError(
                "GraphedStep captures a CUDA graph: every parameter must be on a CUDA device "
                f"({len(off)} of {len(params)} are not)"
            )
        if optimizer.divides_work or any(optimizer._sharding(p).kind != "local" for p in params):
            raise ValueError(
                "GraphedStep needs plain (unsharded, undivided) parameters: a step that sends "
                "collectives is not captured; step such an optimizer eagerly or compiled"
            )
        if any(g["nonfinite"] == "raise" for g in optimizer.param_groups):
            raise ValueError('GraphedStep cannot raise from inside a graph: use nonfinite="skip"')
        self.optimizer = optimizer
        self.warmup = warmup
        self.steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._grads: list[torch.Tensor | None] = []
        self._lrs: list[torch.Tensor] = []
        self._state_ptrs: list[int] = []

    def __call__(self) -> None:
        """One optimizer step: eager while warming up, then captured once and replayed."""
        opt = self.optimizer
        if self.graph is None and self.steps < self.warmup:
            self._eager_on_side_stream()
        elif self.graph is None:
            self._capture().replay()  # the capture itself ran nothing
        else:
            self._check()
            opt._step_peers()
            lrs = opt._lr_tensors()
            if any(a.data_ptr() != b.data_ptr() for a, b in zip(lrs, self._lrs)):
                raise RuntimeError(
                    "GraphedStep: a learning-rate tensor was replaced since the capture; update a "
                    "tensor lr in place (lr.fill_(...)) or set a float lr"
                )
            self.graph.replay()
        self.steps += 1
        opt._opt_called = True  # what torch.optim's step wrapper records for LR schedulers

    step = __call__

    def _eager_on_side_stream(self) -> None:
        """An eager step on a side stream, as CUDA-graph warm-up asks (libraries set up there)."""
        opt = self.optimizer
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            opt._check_gradients()
            opt._step_peers()
            opt._refresh_buckets()
            opt._last_flags = opt._step_impl(opt._lr_tensors())
        torch.cuda.current_stream().wait_stream(side)

    def _capture(self) -> torch.cuda.CUDAGraph:
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        if any(p.grad is None for p in params):
            missing = [n for g in opt.param_groups for n, p in zip(g["names"], g["params"]) if p.grad is None]
            raise RuntimeError(
                "GraphedStep captures the step with every gradient present; these have none: "
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (give them gradients, "
                "or leave them out of the optimizer)"
            )
        opt._step_peers()
        opt._refresh_buckets()
        opt._skip_counter()
        self._lrs = opt._lr_tensors()
        self._grads = [p.grad for p in params]
        self._state_ptrs = self._state_pointers()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            opt._last_flags = opt._step_impl(self._lrs)
        self.graph = graph
        return graph

    def _state_pointers(self) -> list[int]:
        states = [st for st in self.optimizer.state.values() if isinstance(st, dict)]
        return [t.data_ptr() for st in states for t in st.values() if torch.is_tensor(t)]

    def _check(self) -> None:
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        if len(params) != len(self._grads) or any(p.grad is not g for p, g in zip(params, self._grads)):
            raise RuntimeError(
                "GraphedStep replays the step over the gradient tensors it captured, and a gradient "
                "was replaced or cleared: zero gradients with zero_grad(set_to_none=False)"
            )
        if self._state_pointers() != self._state_ptrs:
            raise RuntimeError(
                "GraphedStep: the optimizer's state was replaced since the capture (a loaded state "
                "dict or a new group); make a new GraphedStep"
            )
