"""A process's RNG states (torch, the CUDA device, Python, NumPy) as JSON data, and back;
saved per rank in ``rank_<r>.json``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def rng_state(device: torch.device | str = "cpu") -> dict[str, Any]:
    """This process's RNG states (torch, CUDA device, Python, NumPy) as JSON-serialisable data."""
    import base64
    import random

    import numpy as np

    def encode(t: torch.Tensor) -> str:
        return base64.b64encode(t.cpu().numpy().tobytes()).decode()

    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": encode(torch.get_rng_state()),
        "python": [version, list(internal), gauss],
        "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }
    device = torch.device(device)
    if device.type == "cuda":
        state["cuda"] = encode(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device | str = "cpu") -> None:
    """Restore what :func:`rng_state` returned."""
    import base64
    import random

    import numpy as np

    def decode(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(decode(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    device = torch.device(device)
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(decode(state["cuda"]), device)
