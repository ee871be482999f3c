"""Update rules of :class:`~equiopt.optim.EquivariantOptimizer`, one module each, behind
the small protocol of :class:`Rule` (:mod:`.base`), and the registry the step, the
settings table and the recipes read.

A matrix rule maps the (momentum) direction's work matrices ``D`` to an update ``U`` of
the same shape with the pure maps of :mod:`equiopt.maps`; the element-wise rules
(``adamw``, ``sgd``) act on the stored tensor directly; the peer rules hand a group to a
torch optimizer. Adding a rule is its module and one :func:`register` call::

    class Sign(Rule):
        name = "sign"
        fields = MOMENTUM_FIELDS
        def factored(self, key, eta, D, **_):
            return maps.Factored(D.sign())

    register(Sign())
"""

from __future__ import annotations

from .base import (
    LR_SCALES,
    MOMENTUM_FIELDS,
    PeerRule,
    Rule,
    RuleNames,
    check_fields,
    polar_flops,
    register,
    registered,
    rule_named,
    rule_of,
    rules,
    unregister,
)
from .elementwise import SGD, AdamW
from .gram import Hybrid, Left, Right
from .keys import (
    NARROW_RULES,
    PRECENTRED,
    MapKey,
    apply_map,
    factor_flags,
    factored_map,
    finite_flags_of,
    lr_scale_factor,
    map_key,
    precentred,
    reducible,
    shape_factor,
    validate_group,
)
from .normuon import NorMuon
from .peers import TorchAdamW, TorchMuon
from .polar import Spectral, SpectralRow
from .row import RowNorm

__all__ = [
    "LR_SCALES",
    "MOMENTUM_FIELDS",
    "NARROW_RULES",
    "PRECENTRED",
    "MapKey",
    "PeerRule",
    "Rule",
    "RuleNames",
    "apply_map",
    "check_fields",
    "factor_flags",
    "factored_map",
    "finite_flags_of",
    "lr_scale_factor",
    "map_key",
    "polar_flops",
    "precentred",
    "reducible",
    "register",
    "registered",
    "rule_named",
    "rule_of",
    "rules",
    "shape_factor",
    "unregister",
    "validate_group",
]

# the built-in rules, in the order the settings table lists them
for _rule in (
    Spectral(),
    Right(),
    Left(),
    RowNorm(),
    Hybrid(),
    SpectralRow(),
    NorMuon(),
    AdamW(),
    SGD(),
    TorchAdamW(),
    TorchMuon(),
):
    register(_rule)
del _rule
