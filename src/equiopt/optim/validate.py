"""torch's contract for an optimizer's hyperparameters and parameter names.

Hyperparameters: torch's optimizers check theirs before they read ``params``
(``torch.optim.AdamW(None, lr=torch.tensor([1., 2.]))`` raises
``ValueError("Tensor lr must be 1-element")``), with messages such as
``"Invalid learning rate: -1"``; :func:`check_hyperparameters` does the same for the
constructor's settings, each message torch's where torch has one, followed by the setting
and the range of :data:`~.fields.FIELDS`.

Names: a param group names its parameters once, with torch's ``param_names`` (from
``named_parameters()``, or given). ``names``, the earlier spelling, is accepted in a
group and in a saved state dict; the live group's ``names`` are the names messages use
(``param_names``, else the parameters' places) and are not saved.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .fields import FIELDS

__all__ = ["check_hyperparameters", "default_names", "is_default", "names_of", "saved_param_names"]

#: torch's message for an invalid value of each setting (``{}``: the value as given);
#: ``beta`` is torch's ``momentum`` (SGD, Muon).
_TORCH_MESSAGES = {
    "lr": "Invalid learning rate: {}",
    "eps": "Invalid epsilon value: {}",
    "adam_eps": "Invalid epsilon value: {}",
    "weight_decay": "Invalid weight_decay value: {}",
    "beta": "Invalid momentum value: {}",
    "beta2": "Invalid beta2 value: {}",
    "alpha": "Invalid alpha value: {}",
    "steps": "Invalid steps value: {}",
}

#: The settings checked before ``params`` is read: the rule, and those whose range does not
#: depend on it.
CHECKED_FIRST: tuple[str, ...] = (
    "rule",
    "lr",
    "betas",
    "eps",
    "adam_eps",
    "weight_decay",
    "beta",
    "beta2",
    "alpha",
    "steps",
)


def _torch_message(name: str, value: Any) -> str:
    if name == "lr" and isinstance(value, torch.Tensor) and value.numel() != 1:
        return "Tensor lr must be 1-element"
    if name == "betas":
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) == 2:
            tensors = [isinstance(b, torch.Tensor) for b in value]
            if any(tensors) and not all(tensors):
                return "betas must be either both floats or both Tensors"
            for i, b in enumerate(value):
                if isinstance(b, (int, float)) and not isinstance(b, bool) and not 0.0 <= b < 1.0:
                    return f"Invalid beta parameter at index {i}: {b}"
        return f"Invalid betas: {value!r}"
    if name == "rule":
        return f"Invalid rule: {value!r}"
    return _TORCH_MESSAGES[name].format(value)


def check_hyperparameters(settings: Mapping[str, Any], where: str = "") -> None:
    """Check the settings of :data:`CHECKED_FIRST` in ``settings`` (``None``: the rule's
    default, not checked here), as torch checks its optimizers' arguments before it reads
    ``params``.

    Raises:
        ValueError: torch's message, then ``(<where>, field '<name>': <the range>)``.
    """
    context = f"{where}, " if where else ""
    for name in CHECKED_FIRST:
        value = settings.get(name)
        if value is None:
            continue
        try:
            FIELDS[name].check(value, str(settings.get("rule") or ""))
        except ValueError as err:
            message = _torch_message(name, value)
            detail = "" if str(err) == message else f": {err}"
            raise ValueError(f"{message} ({context}field {name!r}{detail})") from None


# ------------------------------------------------------------------ names
def default_names(where: str, count: int) -> list[str]:
    """The names of a param group's parameters when it gives none: their places."""
    return [f"{where}.params[{j}]" for j in range(count)]


_PLACE = re.compile(r"param_groups\[\d+\]")


def is_default(names: Sequence[str]) -> bool:
    """Whether ``names`` are the places of a group's parameters (:func:`default_names` of
    some group), that is, the group was given no names."""
    if not names:
        return True
    where = _PLACE.match(str(names[0]))
    return where is not None and list(names) == default_names(where.group(0), len(names))


def names_of(group: dict, where: str) -> list[str]:
    """The names of ``group``'s parameters: its ``param_names`` (torch's), else its ``names``
    (the earlier spelling), else their places.

    Raises:
        ValueError: a list of the wrong length, or ``names`` that contradict ``param_names``.
    """
    count = len(group["params"])
    names = group.get("param_names")
    given = group.get("names")
    key = "param_names"
    if names is None:
        names, key = given, "names"
    elif given is not None and list(given) != list(names) and not is_default(given):
        raise ValueError(f"{where}: 'names' {list(given)} and 'param_names' {list(names)} differ; give param_names")
    if names is None:
        return default_names(where, count)
    if len(names) != count:
        raise ValueError(f"{where}: {key!r} has {len(names)} entries for {count} parameters")
    return list(names)


def saved_param_names(group: dict) -> list[str] | None:
    """A saved group's names in the current form (in place): its ``param_names``, or the
    ``names`` an earlier version saved beside them (taken as ``param_names`` unless they
    are places); ``names`` is removed."""
    old = group.pop("names", None)
    if group.get("param_names") is None and old is not None and not is_default(old):
        group["param_names"] = list(old)
    names = group.get("param_names")
    return None if names is None else list(names)
