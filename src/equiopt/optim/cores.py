"""Compiled cores of the bucketed step (:class:`Cores`): ``torch.compile`` of a bucket's or
part's core, one per kind, with a fallback to eager where compiling fails."""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Cores"]


class Cores:
    """Compiled cores (``torch.compile`` of :func:`bucket_core` and :func:`adamw_core`), one
    per kind of bucket or part: each kind gets its own copy of the function's code, so
    Dynamo's cache (and its recompilation limit) counts per kind, and buckets of one kind
    (equal settings, shapes and dtypes) share one compiled graph.

    ``fallback``: a core that fails to compile (before it runs anything) warns once and runs
    eagerly from then on; otherwise the error is raised. :attr:`failed` keeps the error."""

    def __init__(self, backend: Any, fallback: bool = False):
        self.backend = backend
        self.fallback = fallback
        self.failed: BaseException | None = None
        self.kinds: dict[tuple, Callable] = {}

    def compiled(self, fn: Callable, kind: tuple) -> Callable:
        key = (fn.__name__, kind)
        found = self.kinds.get(key)
        if found is None:
            name = f"{fn.__name__}_{len(self.kinds)}"
            code = fn.__code__.replace(co_name=name)
            fresh = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
            found = self.kinds[key] = torch.compile(fresh, backend=self.backend, fullgraph=True, dynamic=False)
        return found

    def __call__(self, fn: Callable, kind: tuple) -> Callable:
        if self.failed is not None:
            return fn
        compiled = self.compiled(fn, kind)

        def run(*args):
            if self.failed is not None:
                return fn(*args)
            try:
                return compiled(*args)
            except (torch._dynamo.exc.TorchDynamoException, AssertionError) as err:
                # compiling fails before the core runs (Dynamo's own assertions raise
                # AssertionError); a genuine error of the core comes back from the eager call
                if not self.fallback:
                    raise
                self.failed = err
                warnings.warn(
                    f"EquivariantOptimizer: compiling the step failed ({type(err).__name__}: {err}); "
                    "stepping eagerly from now on (pass compile=False to silence, compile=True to raise)",
                    stacklevel=5,
                )
                return fn(*args)

        return run
