"""The explicit ``rules=`` of :func:`~equiopt.roles.assign_roles`: a regex on parameter
names -> a role, or a role and a layout; the first match wins."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

from ...layouts import Layout, parse_layout
from ..table import ROLES


class _RoleRule(NamedTuple):
    """One entry of ``rules=``: parameters whose name matches ``pattern`` get ``role`` and
    ``layout`` (None: the layout inference gives for that role)."""

    pattern: re.Pattern
    role: str
    layout: Layout | None


def rule_table(rules) -> list[_RoleRule]:
    """``rules`` (a mapping or pairs of a pattern and a role, or None) as the ordered table
    the role inference matches names against."""
    if rules is None:
        return []
    items = rules.items() if isinstance(rules, Mapping) else rules
    table = []
    for pattern, spec in items:
        if isinstance(spec, str):
            role, layout = spec, None
        elif isinstance(spec, Mapping):
            role, layout = spec.get("role"), spec.get("layout")
        else:
            role, layout = spec
        if role not in ROLES:
            raise ValueError(f"rule {pattern!r}: unknown role {role!r}; valid: {', '.join(ROLES)}")
        table.append(_RoleRule(re.compile(pattern), role, None if layout is None else parse_layout(layout)))
    return table
