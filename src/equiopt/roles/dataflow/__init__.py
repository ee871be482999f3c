"""Roles from the dataflow: one forward of the model on fake tensors shows what each
parameter does (``trace``), and that decides its role and layout (``decide``).

:func:`findings` is the entry point :func:`~equiopt.roles.assign_roles` uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .decide import Finding, decide
from .trace import Evidence, TraceFailed, register_trace_forward, trace_model

__all__ = [
    "Finding",
    "Evidence",
    "TraceFailed",
    "Findings",
    "findings",
    "trace_model",
    "decide",
    "bare_model",
    "register_trace_forward",
]


@dataclass
class Findings:
    """The dataflow's decisions, by ``id`` of the parameter, or why there are none."""

    by_param: dict[int, Finding] = field(default_factory=dict)
    failed: str | None = None
    tied: bool = False


def bare_model(model: nn.Module) -> nn.Module:
    """The model inside DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    from torch.nn.parallel import DistributedDataParallel

    seen = 0
    while seen < 8:
        seen += 1
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            break
    return model


def _candidates(model: nn.Module):
    """The model, then (when its own forward cannot run on a token batch) the submodule
    that holds all its trainable parameters, outermost first (a LightningModule's model)."""
    yield model
    total = {id(p) for p in model.parameters() if p.requires_grad}
    for _, sub in model.named_modules():
        if sub is model:
            continue
        if {id(p) for p in sub.parameters() if p.requires_grad} == total:
            yield sub
            return


#: codebases whose models need trace forwards of their own, and the module that registers them
_PLUGINS = {"olmo_core": "equiopt.integrations.olmo_core", "torchtitan": "equiopt.integrations.torchtitan"}


def _load_plugins(model: nn.Module) -> None:
    import importlib

    roots = {type(m).__module__.split(".")[0] for m in model.modules()}
    for root in roots & set(_PLUGINS):
        importlib.import_module(_PLUGINS[root])


def findings(model: nn.Module, split: bool = True, per_head: bool = True) -> Findings:
    """Trace ``model`` (bare or wrapped) and decide every parameter it uses as a weight."""
    _load_plugins(model)
    errors = []
    for candidate in _candidates(bare_model(model)):
        try:
            evidence = trace_model(candidate)
        except TraceFailed as err:
            errors.append(f"{type(candidate).__name__}: {err}")
            continue
        decided = decide(evidence, split=split, per_head=per_head)
        by_param = {id(evidence.params[pid]): f for pid, f in decided.items()}
        tied = any(f.role == "embedding" and "lm_head" in f.roles_seen for f in decided.values())
        return Findings(by_param, None, tied)
    return Findings({}, "; ".join(errors) or "no forward to run", False)
