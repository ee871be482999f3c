"""The element-wise rules, acting on the stored tensor: AdamW (decoupled weight decay,
Loshchilov and Hutter) and SGD with EMA momentum (optionally Nesterov's)."""

from __future__ import annotations

from .base import MOMENTUM_FIELDS, Rule

ADAM_STATE = ("exp_avg", "exp_avg_sq")


class AdamW(Rule):
    name = "adamw"
    kind = "elementwise"
    fields = ("betas", "adam_eps", "nonfinite")
    state = ADAM_STATE
    complex = True
    doc = "AdamW"


class SGD(Rule):
    name = "sgd"
    kind = "elementwise"
    fields = MOMENTUM_FIELDS
    complex = True
    doc = "SGD with EMA momentum"
