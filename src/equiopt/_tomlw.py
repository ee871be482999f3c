"""Writing the TOML subset equiopt's recipe and run-config files use (tomllib only reads)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["toml_key", "toml_value", "toml_tables"]

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def toml_key(key: str) -> str:
    """A bare key where TOML allows one, else a quoted one (``"*"``, ``"a.b"``)."""
    return key if _BARE.match(key) else json.dumps(key, ensure_ascii=False)


def toml_value(value: Any) -> str:
    """One value: booleans, integers, finite floats, strings, arrays and inline tables."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot write non-finite number {value!r} to TOML")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":  # torch.bfloat16 -> "bfloat16"
        return json.dumps(str(value).removeprefix("torch."))
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{toml_key(str(k))} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} to TOML")


def toml_tables(data: Mapping[str, Mapping[str, Any]]) -> str:
    """Top-level tables of ``key = value`` lines; ``None`` values and empty tables are left out."""
    blocks = []
    for name, table in data.items():
        lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items() if v is not None and v != {}]
        if lines:
            blocks.append(f"[{toml_key(name)}]\n" + "\n".join(lines))
    return "\n\n".join(blocks) + "\n"
