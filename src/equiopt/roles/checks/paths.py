"""Parameter names as module paths: the module that owns a parameter, the prefix shared
by two names (which groups an MLP's parameters into one block), whether a name lies in
a block, and a list of names with their common prefix factored out."""

from __future__ import annotations

from collections.abc import Sequence


def _module_name(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _module_path(name: str) -> list[str]:
    return name.split(".")[:-1]


def _common(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _under(name: str, prefix: str) -> bool:
    """Whether parameter ``name`` lies in the module at path ``prefix`` (``""``: the model)."""
    return prefix == "" or name.startswith(prefix + ".")


def _compress(names: Sequence[str]) -> str:
    if not names:
        return ""
    if len(names) == 1:
        return names[0]
    paths = [n.split(".") for n in names]
    k = min(len(p) for p in paths) - 1
    n = 0
    while n < k and all(p[n] == paths[0][n] for p in paths):
        n += 1
    if n == 0:
        return ", ".join(names)
    return ".".join(paths[0][:n]) + ".{" + ", ".join(".".join(p[n:]) for p in paths) + "}"
