"""torch's own optimizers as rules: the outside reference arms of a comparison.

A comparison that only ever runs equiopt's own code cannot tell a reader whether
equiopt's Muon or AdamW matches the implementations everyone else uses. The peer rules
hand a param group to torch's optimizer classes, unchanged:

``torch_adamw``
    ``torch.optim.AdamW`` (fused when every parameter of the group is on CUDA, foreach
    otherwise) with the group's ``lr``, ``betas``, ``adam_eps`` and ``weight_decay``.
``torch_muon``
    ``torch.optim.Muon`` (torch >= 2.9; its quintic Newton-Schulz iteration in bfloat16,
    whose products on a CPU without bfloat16 hardware run as float32 products rounded to
    bfloat16, :func:`equiopt.linalg.polar.bfloat16_products`: the same
    arithmetic, many times faster there)
    with the group's ``lr``, ``beta`` (momentum), ``nesterov``, ``steps`` (``ns_steps``),
    ``weight_decay`` and ``lr_scale`` (``"spectral"``: torch's ``"original"``,
    ``sqrt(max(1, rows/cols))``; ``"match_adamw"``: its ``"match_rms_adamw"``). It steps
    whole 2-D matrices only: a group with a stacked or sharded parameter is refused by name.

The inner optimizer keeps its state in the outer optimizer's ``state`` (torch's own keys:
``step``, ``exp_avg``, ``exp_avg_sq``; ``momentum_buffer``), so ``state_dict``,
distributed checkpoints and resumption work as for every other rule; learning-rate
schedules act on the outer group and are copied in before each step. Peers behave as
torch does: no skipping of non-finite gradients (the training loop stops a run whose
loss is not finite) and no division of work among replicas.
"""

from __future__ import annotations

from typing import Any

import torch

from ...linalg.polar import bfloat16_products
from .base import PeerRule, polar_flops
from .elementwise import ADAM_STATE

_MUON_LR_FN = {"spectral": "original", "match_adamw": "match_rms_adamw"}


def _muon_class():
    cls = getattr(torch.optim, "Muon", None)
    if cls is None:
        raise ValueError(
            f"rule 'torch_muon' needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}: "
            "use rule 'spectral' (equiopt's Muon) or a newer torch"
        )
    return cls


def _common(group: dict) -> dict[str, Any]:
    return {"lr": float(group["lr"]), "weight_decay": float(group["weight_decay"])}


class TorchAdamW(PeerRule):
    name = "torch_adamw"
    fields = ("betas", "adam_eps")
    state = ADAM_STATE
    complex = True
    doc = "torch.optim.AdamW, as a peer arm"

    def hyper(self, group: dict) -> dict[str, Any]:
        return {**_common(group), "betas": tuple(group["betas"]), "eps": float(group["adam_eps"])}

    def build(self, group: dict) -> torch.optim.Optimizer:
        params = list(group["params"])
        on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
        kernel: dict[str, Any] = {"fused": True} if on_cuda else {"foreach": True}
        return torch.optim.AdamW(params, **self.hyper(group), **kernel)


class TorchMuon(PeerRule):
    name = "torch_muon"
    fields = ("beta", "nesterov", "steps", "lr_scale")
    defaults = {"nesterov": True}
    # torch's Muon knows Jordan's factor ("original") and Moonlight's ("match_rms_adamw") only
    lr_scales = ("spectral", "match_adamw")
    doc = "torch.optim.Muon, as a peer arm"

    def flops(self, key, batch: int, m: int, n: int, gram_rows: int | None) -> int:
        return polar_flops(key, batch, m, n)

    def check_param(self, p: torch.Tensor, name: str, sharded: bool) -> None:
        _muon_class()
        if p.ndim != 2:
            raise ValueError(
                f"parameter {name!r} has shape {tuple(p.shape)}: rule 'torch_muon' (torch.optim.Muon) steps 2-D "
                "matrices only; give stacked experts rule 'spectral' (equiopt's Muon, one map per expert)"
            )
        if sharded:
            raise ValueError(
                f"parameter {name!r} is sharded: rule 'torch_muon' (torch.optim.Muon) needs whole matrices; "
                "use rule 'spectral' (equiopt's Muon), which steps sharded parameters"
            )

    def hyper(self, group: dict) -> dict[str, Any]:
        return {
            **_common(group),
            "momentum": float(group["beta"]),
            "nesterov": bool(group["nesterov"]),
            "ns_steps": int(group["steps"]),
            "adjust_lr_fn": _MUON_LR_FN[group["lr_scale"]],
        }

    def build(self, group: dict) -> torch.optim.Optimizer:
        return _muon_class()(list(group["params"]), **self.hyper(group))

    def step(self, inner: torch.optim.Optimizer, group: dict) -> None:
        params = group["params"]
        if not params:
            inner.step()
            return
        with bfloat16_products(params[0].device):
            inner.step()
